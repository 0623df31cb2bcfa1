//! What a JSON Lines record is, line by line: one place that the planner,
//! the schema sampler and the reader all count records by.

/// A line that holds a record (not blank): the reader counts records the
/// same way as the planner.
pub fn is_record_line(line: &[u8]) -> bool {
    !line.iter().all(u8::is_ascii_whitespace)
}
