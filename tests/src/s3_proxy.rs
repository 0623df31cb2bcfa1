//! A fault-injecting HTTP proxy in front of the test S3 server: it can
//! answer 503 to every request, only to writes or only to server-side
//! copies, lose the answers to copies it forwarded, delay requests, and
//! counts the requests it forwards by kind (with the time they took). Each request goes upstream on its own
//! connection (`Connection: close`), so the proxy only needs to find the end
//! of each request, not of each response.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the proxy does to requests now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Answer 503 to every request.
    pub fail_all: bool,
    /// Answer 503 to writes (PUT, POST, DELETE); reads pass.
    pub fail_writes: bool,
    /// Answer 503 to this many server-side copies (PUT with
    /// `x-amz-copy-source`), then let them through.
    pub fail_copies: u32,
    /// Forward this many copies, then drop each connection without an
    /// answer: the copy happened, and the client does not know it.
    pub lose_copy_answers: u32,
    /// Hold each request this long before forwarding it.
    pub delay: Duration,
    /// A black hole: hold every request, answering nothing, until this is
    /// cleared; then forward those whose client still waits (a client
    /// that gave up closed its connection, and nothing of it arrived).
    pub black_hole: bool,
}

#[derive(Debug, Default)]
struct Shared {
    faults: Faults,
    /// Forwarded requests by kind ("GET", "PUT", "PUT part", "PUT copy", ...).
    counts: BTreeMap<String, u64>,
    /// Time forwarded requests took upstream, by kind.
    times: BTreeMap<String, Duration>,
    /// Requests answered with an injected 503.
    injected: u64,
    /// Requests a black hole held, and those of them dropped because
    /// their client gave up.
    held: u64,
    dropped: u64,
}

/// A running proxy; it stops with the test process.
#[derive(Debug, Clone)]
pub struct S3Proxy {
    pub port: u16,
    shared: Arc<Mutex<Shared>>,
}

impl S3Proxy {
    /// Proxies 127.0.0.1:<port> to `upstream_port` on 127.0.0.1.
    pub fn start(upstream_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let accept_shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let shared = Arc::clone(&accept_shared);
                std::thread::spawn(move || {
                    let _ = serve(conn, upstream_port, &shared);
                });
            }
        });
        Self { port, shared }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn set(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    /// The faults still to strike (counted ones go down as they do).
    pub fn faults(&self) -> Faults {
        self.lock().faults.clone()
    }

    /// Requests forwarded so far, by kind.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.lock().counts.clone()
    }

    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    /// (requests held by a black hole, those dropped as their client gave up).
    pub fn held(&self) -> (u64, u64) {
        let s = self.lock();
        (s.held, s.dropped)
    }

    /// Time the forwarded requests took upstream so far, by kind.
    pub fn times(&self) -> BTreeMap<String, Duration> {
        self.lock().times.clone()
    }

    pub fn reset_counts(&self) {
        let mut s = self.lock();
        s.counts.clear();
        s.times.clear();
        s.injected = 0;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The kind of an S3 request, for counting.
fn kind(method: &str, target: &str, copy: bool) -> String {
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let tag = if copy {
        " copy"
    } else if query.contains("uploadId=") && query.contains("partNumber=") {
        " part"
    } else if query.contains("uploads") || query.contains("uploadId=") {
        " multipart"
    } else if query.contains("list-type=") || (method == "GET" && target.ends_with('/')) {
        " list"
    } else {
        ""
    };
    // Requests for a Delta table's log, counted apart (the cost of its
    // commits: bench_s3's Delta run).
    // And an Iceberg table's metadata (metadata files, manifest lists,
    // manifests: its commits' cost).
    let log = if target.contains("_delta_log") {
        " delta-log"
    } else if target.contains("/metadata/") && target.contains("/warehouse/") {
        " iceberg-metadata"
    } else {
        ""
    };
    format!("{method}{tag}{log}")
}

/// Whether the client is still connected (a closed connection reads as
/// its end at once).
fn still_waiting(client: &TcpStream) -> bool {
    if client.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let open = match client.peek(&mut byte) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    };
    open && client.set_nonblocking(false).is_ok()
}

fn serve(client: TcpStream, upstream_port: u16, shared: &Mutex<Shared>) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut client = client;
    loop {
        // The request head.
        let mut head = Vec::new();
        let mut content_length = 0usize;
        let mut copy = false;
        let mut request_line = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            if request_line.is_empty() {
                request_line = line.trim_end().to_string();
            }
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                content_length = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("x-amz-copy-source:") {
                copy = true;
            }
            if lower.starts_with("connection:") {
                continue;
            }
            head.extend_from_slice(line.as_bytes());
        }
        head.extend_from_slice(b"Connection: close\r\n\r\n");
        let mut body = vec![0u8; content_length];
        reader.read_exact(&mut body)?;
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("").to_string();
        // Counted faults are used up as they strike.
        let (faults, fail_copy, lose_answer) = {
            let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
            let fail_copy = copy && s.faults.fail_copies > 0;
            let lose_answer = copy && !fail_copy && s.faults.lose_copy_answers > 0;
            if fail_copy {
                s.faults.fail_copies -= 1;
            }
            if lose_answer {
                s.faults.lose_copy_answers -= 1;
            }
            (s.faults.clone(), fail_copy, lose_answer)
        };
        if !faults.delay.is_zero() {
            std::thread::sleep(faults.delay);
        }
        if faults.black_hole {
            shared.lock().unwrap_or_else(|p| p.into_inner()).held += 1;
            while shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .faults
                .black_hole
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !still_waiting(&client) {
                shared.lock().unwrap_or_else(|p| p.into_inner()).dropped += 1;
                return Ok(());
            }
        }
        let is_write = matches!(method.as_str(), "PUT" | "POST" | "DELETE");
        if faults.fail_all || (faults.fail_writes && is_write) || fail_copy {
            shared.lock().unwrap_or_else(|p| p.into_inner()).injected += 1;
            let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>\
                        <Message>injected by the test proxy</Message></Error>";
            write!(
                client,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            client.flush()?;
            continue;
        }
        let kind = kind(&method, &target, copy);
        *shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .counts
            .entry(kind.clone())
            .or_default() += 1;
        let started = std::time::Instant::now();
        let mut upstream = match TcpStream::connect(("127.0.0.1", upstream_port)) {
            Ok(s) => s,
            // The server is down: drop the client's connection, as a dead
            // server would.
            Err(_) => return Ok(()),
        };
        upstream.write_all(&head)?;
        upstream.write_all(&body)?;
        upstream.flush()?;
        // The response runs until the upstream closes (Connection: close);
        // the client's connection closes with it, and says so, so the client
        // does not reuse it.
        let mut response = BufReader::new(upstream);
        // Upstream answered once its status line arrives.
        let mut status_line = String::new();
        response.read_line(&mut status_line)?;
        *shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .times
            .entry(kind)
            .or_default() += started.elapsed();
        if lose_answer {
            shared.lock().unwrap_or_else(|p| p.into_inner()).injected += 1;
            return Ok(());
        }
        client.write_all(status_line.as_bytes())?;
        loop {
            let mut line = String::new();
            if response.read_line(&mut line)? == 0 {
                return Ok(());
            }
            if line == "\r\n" {
                client.write_all(b"Connection: close\r\n\r\n")?;
                break;
            }
            if !line.to_ascii_lowercase().starts_with("connection:") {
                client.write_all(line.as_bytes())?;
            }
        }
        std::io::copy(&mut response, &mut client)?;
        client.flush()?;
        return Ok(());
    }
}
