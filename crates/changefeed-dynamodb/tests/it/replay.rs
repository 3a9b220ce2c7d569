//! A loopback HTTP server answering the DynamoDB Streams API with given bodies: for what no
//! local server produces in a test's time (a shard rollover, data trimmed by retention, an
//! expired iterator), served to the real SDK client so that the source reads them exactly as
//! it would AWS's answers.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// One request as it came: the operation (`DescribeStream` …, from `X-Amz-Target`) and the
/// JSON body.
pub type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// An answer: the HTTP status and the JSON body (an error is a 400 with `__type`).
pub type Answer = (u16, String);

/// The body of a Streams API error of type `code`.
pub fn error(code: &str, message: &str) -> Answer {
    (
        400,
        serde_json::json!({
            "__type": format!("com.amazonaws.dynamodb.v20120810#{code}"),
            "message": message,
        })
        .to_string(),
    )
}

/// Serves `answer(operation, body, n)` on loopback, `n` counting the requests before this one.
/// Returns the endpoint and the requests seen.
pub async fn serve<F>(answer: F) -> (String, Seen)
where
    F: Fn(&str, &str, usize) -> Answer + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("address");
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (log, answer) = (log.clone(), answer.clone());
            tokio::spawn(async move {
                let mut socket = BufReader::new(socket);
                loop {
                    let (mut length, mut target) = (0usize, String::new());
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if socket.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if lower.starts_with("x-amz-target:") {
                            target = line
                                .trim()
                                .rsplit('.')
                                .next()
                                .unwrap_or_default()
                                .to_string();
                        }
                    }
                    let mut body = vec![0; length];
                    if socket.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let body = String::from_utf8_lossy(&body).into_owned();
                    let n = {
                        let mut log = log.lock().expect("log");
                        log.push((target.clone(), body.clone()));
                        log.len() - 1
                    };
                    let (status, reply) = answer(&target, &body, n);
                    let reason = if status == 200 { "OK" } else { "Bad Request" };
                    let head = format!(
                        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/x-amz-json-1.0\r\n\
                         Content-Length: {}\r\n\r\n",
                        reply.len()
                    );
                    let sent = socket.get_mut().write_all(head.as_bytes()).await;
                    if sent.is_err() || socket.get_mut().write_all(reply.as_bytes()).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), seen)
}
