//! The handler's ledger: one file per batch, a line per record, `<start_ms> <end_ms> <host>
//! <record as JSON>`, stamped with this machine's clock when the handler started and ended;
//! and what it shows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::Context as _;
use changefeed::source::{key_hash, split_key_space};

/// What the ledger shows against what was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checked {
    /// Records written.
    pub written: u64,
    /// Records written but never delivered.
    pub lost: u64,
    /// Batches whose handler ran while another host's handler ran on the same partition.
    pub overlapping: u64,
    /// Records whose first delivery came after that of a later record of the same key.
    pub reordered: u64,
    /// Deliveries beyond the first of a record.
    pub duplicates: u64,
}

/// Now on this machine's wall clock, in milliseconds (the handler's `date +%s%3N`).
pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// `per` keys for each of `partitions` equal key ranges.
pub(super) fn keys(partitions: u32, per: usize) -> Vec<String> {
    let ranges = split_key_space(partitions);
    let mut found: Vec<Vec<String>> = vec![Vec::new(); ranges.len()];
    let mut i = 0u64;
    while found.iter().any(|f| f.len() < per) {
        let key = format!("k{i}");
        let h = key_hash(&key);
        if let Some(slot) = ranges.iter().position(|r| r.start <= h && h <= r.end) {
            if found[slot].len() < per {
                found[slot].push(key);
            }
        }
        i += 1;
    }
    found.into_iter().flatten().collect()
}

struct Batch {
    start: i64,
    end: i64,
    host: String,
    partition: String,
    /// (key, seq) in delivery order.
    records: Vec<(String, i64)>,
}

/// The ledger as read so far: each batch file is read once.
#[derive(Default)]
pub(super) struct Ledger {
    read: std::collections::HashSet<std::ffi::OsString>,
    batches: Vec<Batch>,
}

impl Ledger {
    /// Reads the batch files written since the last call.
    pub(super) fn refresh(&mut self, dir: &Path) -> anyhow::Result<()> {
        let mut added = false;
        for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
            let entry = entry?;
            if self.read.contains(&entry.file_name()) {
                continue;
            }
            let path = entry.path();
            let text = std::fs::read_to_string(&path)?;
            // The handler writes its file in one go at the end; a file without its final
            // newline is still being written: read it next time.
            if !text.ends_with('\n') {
                continue;
            }
            self.read.insert(entry.file_name());
            self.batches.extend(parse(&path, &text)?);
            added = true;
        }
        if added {
            self.batches.sort_by_key(|b| (b.start, b.end));
        }
        Ok(())
    }
}

fn parse(path: &Path, text: &str) -> anyhow::Result<Option<Batch>> {
    let mut batch: Option<Batch> = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.splitn(4, ' ');
        let (Some(start), Some(end), Some(host), Some(json)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("{}: malformed ledger line {line:?}", path.display());
        };
        let record: serde_json::Value = serde_json::from_str(json)
            .with_context(|| format!("{}: record {json:?}", path.display()))?;
        let field = |k: &str| record.get(k).cloned().unwrap_or_default();
        let seq = match field("data") {
            serde_json::Value::String(s) => s.parse::<i64>().ok(),
            serde_json::Value::Number(n) => n.as_i64(),
            _ => None,
        }
        .with_context(|| format!("{}: no sequence number in {json:?}", path.display()))?;
        let key = field("key").as_str().unwrap_or_default().to_string();
        let b = batch.get_or_insert_with(|| Batch {
            start: start.parse().unwrap_or_default(),
            end: end.parse().unwrap_or_default(),
            host: host.to_string(),
            partition: field("partition").as_str().unwrap_or_default().to_string(),
            records: Vec::new(),
        });
        b.records.push((key, seq));
    }
    Ok(batch)
}

/// When `host` first started a batch at or after `after_ms`, if it has.
pub(super) fn first_start_after(ledger: &Ledger, host: &str, after_ms: i64) -> Option<i64> {
    ledger
        .batches
        .iter()
        .filter(|b| b.host == host && b.start >= after_ms)
        .map(|b| b.start)
        .min()
}

/// Checks the ledger against `written` (key → records written, numbered from 0).
pub(super) fn check(ledger: &Ledger, written: &BTreeMap<String, i64>) -> Checked {
    let batches = &ledger.batches;
    let mut checked = Checked {
        written: written
            .values()
            .map(|n| u64::try_from(*n).unwrap_or(0))
            .sum(),
        ..Checked::default()
    };
    let mut seen: BTreeSet<(String, i64)> = BTreeSet::new();
    let mut last_first: BTreeMap<String, i64> = BTreeMap::new();
    // Per partition: the latest end of each host's batches so far (batches in start order).
    let mut ends: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    for b in batches {
        let hosts = ends.entry(b.partition.clone()).or_default();
        if hosts.iter().any(|(h, end)| *h != b.host && *end > b.start) {
            checked.overlapping += 1;
        }
        let end = hosts.entry(b.host.clone()).or_insert(b.end);
        *end = (*end).max(b.end);
        for (key, seq) in &b.records {
            if seen.insert((key.clone(), *seq)) {
                let last = last_first.entry(key.clone()).or_insert(-1);
                if *seq < *last {
                    checked.reordered += 1;
                }
                *last = (*last).max(*seq);
            } else {
                checked.duplicates += 1;
            }
        }
    }
    for (key, n) in written {
        checked.lost += (0..*n)
            .filter(|seq| !seen.contains(&(key.clone(), *seq)))
            .count() as u64;
    }
    checked
}
