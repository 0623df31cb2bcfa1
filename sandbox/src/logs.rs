//! Reading the processes' logs. Tests wait on state read from the
//! coordinator (`/api/status`, the client API) where they can; these are
//! for what only a log says (a worker's own view: a refused commit, a
//! batch it redid) and for failure messages.

/// Removes ANSI colour sequences.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The value of `key=value` in a tracing log line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!(" {key}=");
    let start = line.find(&pat)? + pat.len();
    let rest = &line[start..];
    Some(rest.split_whitespace().next().unwrap_or(""))
}

/// Lines of `log` that contain `what` and, if given, `shard=<shard>` and
/// `token=<token>`.
pub fn lines_with<'a>(
    log: &'a str,
    what: &str,
    shard: Option<&str>,
    token: Option<u64>,
) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.contains(what))
        .filter(|l| shard.is_none_or(|s| field(l, "shard") == Some(s)))
        .filter(|l| token.is_none_or(|t| field(l, "token") == Some(&t.to_string())))
        .collect()
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Finds `key: value` in the CLI's summary output.
pub fn summary_field(output: &str, key: &str) -> Option<String> {
    output
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")).map(str::to_string))
}
