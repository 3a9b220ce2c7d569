//! The `RESULT key=value …` line every subcommand ends with: how it is read back, by
//! `changefeed-bench report` and by the smoke test that runs each `--quick` benchmark.

use std::collections::BTreeMap;

/// The fields of the last `RESULT` line of a benchmark's output, by key. `Err` says what is
/// wrong: no `RESULT` line, a field that is not `key=value`, a key of other than lower-case
/// letters, digits and `_`, an empty value, or a value that is not a finite number
/// (`NaN`, `inf`), which would be a figure computed from nothing.
pub fn parse_last(output: &str) -> Result<BTreeMap<String, String>, String> {
    let line = output
        .lines()
        .rev()
        .find(|l| l.starts_with("RESULT "))
        .ok_or("no RESULT line in the output")?;
    parse(line)
}

/// The fields of one `RESULT` line, by key (see [`parse_last`]).
pub fn parse(line: &str) -> Result<BTreeMap<String, String>, String> {
    let rest = line
        .strip_prefix("RESULT ")
        .ok_or_else(|| format!("not a RESULT line: {line}"))?;
    let mut fields = BTreeMap::new();
    for field in rest.split_whitespace() {
        let (key, value) = field
            .split_once('=')
            .ok_or_else(|| format!("field `{field}` is not key=value"))?;
        let key_ok = !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !key_ok {
            return Err(format!("field `{field}`: the key is not [a-z0-9_]+"));
        }
        if value.is_empty() {
            return Err(format!("field `{field}` has no value"));
        }
        let lower = value.to_ascii_lowercase();
        if ["nan", "inf", "-inf", "+inf"].contains(&lower.as_str()) {
            return Err(format!("field `{field}` is not a finite number"));
        }
        if fields.insert(key.to_string(), value.to_string()).is_some() {
            return Err(format!("key `{key}` appears twice"));
        }
    }
    if fields.is_empty() {
        return Err("the RESULT line has no field".into());
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_last_result_line() {
        let out = "table\nRESULT a=1\nmore\nRESULT b=2.5 c=none\n";
        let f = parse_last(out).expect("parses");
        assert_eq!(f.len(), 2);
        assert_eq!(f["b"], "2.5");
        assert_eq!(f["c"], "none");
    }

    #[test]
    fn refuses_what_is_not_a_figure() {
        assert!(parse_last("no line").is_err());
        assert!(parse("RESULT ").is_err());
        assert!(parse("RESULT a").is_err());
        assert!(parse("RESULT A=1").is_err());
        assert!(parse("RESULT a=").is_err());
        assert!(parse("RESULT a=NaN").is_err());
        assert!(parse("RESULT a=inf").is_err());
        assert!(parse("RESULT a=1 a=2").is_err());
    }
}
