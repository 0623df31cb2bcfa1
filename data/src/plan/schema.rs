//! Inferring a JSON Lines dataset's Arrow schema from sampled lines, at
//! plan time, so every worker decodes every shard alike.

use arrow_schema::Schema;
use serde::Deserialize;

use super::lines::is_record_line;

/// A JSON object's fields in the order the line has them.
struct OrderedObject(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = OrderedObject;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OrderedObject, A::Error> {
                let mut fields = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    fields.push(entry);
                }
                Ok(OrderedObject(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// What kind of value a JSON value is, for the schema vote: numbers are one
/// kind (integers and floats merge to a float), a list's kind is its
/// items' (`list` alone when it has none). `None` for null, which fits any
/// type.
fn value_kind(value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match value {
        Value::Null => None,
        Value::Bool(_) => Some("bool".to_string()),
        Value::Number(_) => Some("number".to_string()),
        Value::String(_) => Some("string".to_string()),
        Value::Object(_) => Some("object".to_string()),
        Value::Array(items) => {
            let mut kinds = items.iter().filter_map(value_kind);
            // An empty list (or one of nulls) fits any list.
            let Some(first) = kinds.next() else {
                return Some("list".to_string());
            };
            if kinds.all(|k| k == first) {
                Some(format!("list<{first}>"))
            } else {
                Some("list<mixed>".to_string())
            }
        }
    }
}

/// Infers a JSON Lines schema from sampled bytes (each sample the start of
/// one object; its last line may be cut off, so lines that do not parse
/// are passed over), up to `max_lines` objects.
///
/// Every field takes the kind of value most of the lines give it, so one
/// bad record (strings in a list of floats) cannot turn the whole column
/// into strings and every good record into a bad one: the bad record is
/// the one that does not decode, and the job's error policy names it.
/// Within the winning kind, types merge as Arrow merges them (an integer
/// and a float give a float).
pub fn infer_jsonl_schema(samples: &[bytes::Bytes], max_lines: usize) -> Result<Schema, String> {
    let mut objects: Vec<Vec<(String, serde_json::Value)>> = Vec::new();
    'samples: for sample in samples {
        for line in sample.split(|&b| b == b'\n').filter(|l| is_record_line(l)) {
            if objects.len() >= max_lines {
                break 'samples;
            }
            if let Ok(OrderedObject(fields)) = serde_json::from_slice::<OrderedObject>(line) {
                objects.push(fields);
            }
        }
    }
    if objects.is_empty() {
        return Err("no line of the sampled bytes is a JSON object".to_string());
    }
    // Field names in first-seen order, and each field's votes by kind.
    let mut names: Vec<String> = Vec::new();
    let mut votes: std::collections::HashMap<String, Vec<(String, usize)>> = Default::default();
    for fields in &objects {
        for (name, value) in fields {
            let tally = match votes.get_mut(name) {
                Some(t) => t,
                None => {
                    names.push(name.clone());
                    votes.entry(name.clone()).or_default()
                }
            };
            if let Some(kind) = value_kind(value) {
                match tally.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, n)) => *n += 1,
                    None => tally.push((kind, 1)),
                }
            }
        }
    }
    let mut schema_fields = Vec::with_capacity(names.len());
    for name in &names {
        let tally = &votes[name];
        // The most common kind; the first seen on a tie.
        let best = tally.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let winner = tally
            .iter()
            .find(|(_, n)| *n == best)
            .map(|(k, _)| k.as_str());
        let mut lines = Vec::new();
        for fields in &objects {
            for (field, value) in fields.iter().filter(|(f, _)| f == name) {
                let kind = value_kind(value);
                let fits = match (kind.as_deref(), winner) {
                    (None, _) => true,
                    (Some(k), Some(w)) => k == w || (k == "list" && w.starts_with("list")),
                    (Some(_), None) => false,
                };
                if fits {
                    let mut one = serde_json::Map::new();
                    one.insert(field.clone(), value.clone());
                    lines.extend_from_slice(serde_json::Value::Object(one).to_string().as_bytes());
                    lines.push(b'\n');
                }
            }
        }
        let (inferred, _) =
            arrow_json::reader::infer_json_schema(std::io::Cursor::new(lines), None)
                .map_err(|e| format!("field {name:?}: {e}"))?;
        let field = inferred
            .field_with_name(name)
            .map_err(|e| format!("field {name:?}: {e}"))?
            .clone();
        schema_fields.push(field);
    }
    Ok(Schema::new(schema_fields))
}
