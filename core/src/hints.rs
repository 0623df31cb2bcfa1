//! What an error likely means when the message alone would not say it.

/// When a gRPC call got an HTTP answer instead of a gRPC one (tonic's
/// `grpc-status header missing, mapped from HTTP status code 404`), the
/// address is most likely the coordinator's HTTP port: a sentence naming
/// the address and the slip. `None` for any other error.
pub fn http_port_hint(addr: &str, message: &str) -> Option<String> {
    let http_status = message
        .split("mapped from HTTP status code ")
        .nth(1)
        .map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap_or("")
        });
    let not_grpc = message.contains("grpc-status header missing")
        || http_status.is_some()
        || message.contains("invalid content-type")
        || message.contains("content-type \"text/");
    if !not_grpc {
        return None;
    }
    let answered = match http_status {
        Some(code) if !code.is_empty() => format!("answered with HTTP {code}, not gRPC"),
        _ => "did not answer as a gRPC server".to_string(),
    };
    Some(format!(
        "{addr} {answered}: is that the coordinator's HTTP port? gRPC listens on --listen, default 7070"
    ))
}

/// An error's shape: the same text with its shard id and numbers masked
/// (batch indices, line numbers, record offsets differ between shards).
pub fn error_signature(error: &str, shard_id: &str) -> String {
    let text = error.replace(shard_id, "<shard>");
    let mut out = String::with_capacity(text.len());
    let mut in_number = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('#');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_answer_names_the_address_and_the_likely_slip() {
        let hint = http_port_hint(
            "http://127.0.0.1:8080",
            "grpc-status header missing, mapped from HTTP status code 404",
        )
        .expect("a hint");
        assert_eq!(
            hint,
            "http://127.0.0.1:8080 answered with HTTP 404, not gRPC: is that the coordinator's HTTP port? gRPC listens on --listen, default 7070"
        );
        assert!(http_port_hint("x:1", "job j-1 not found").is_none());
        assert!(http_port_hint("x:1", "transport error: connection refused").is_none());
    }
}
