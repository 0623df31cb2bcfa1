//! One LLM engine: a child process running our host script (`host.py`)
//! with the engine venv's python, driving vLLM's own engine. The worker
//! talks to it over its stdin and stdout, one JSON object per line, with
//! the standard library only; its stderr is kept (the last lines) as the
//! engine's last words, and logged.
//!
//! The engine must never outlive its worker, however the worker dies:
//! it is spawned with `PR_SET_PDEATHSIG` = SIGKILL from a thread that
//! lives as long as the process (the signal follows the spawning thread,
//! not the process), in its own process group (so stopping it takes any
//! children with it), and the host script exits when its stdin closes.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::LlmError;

/// The host script, shipped inside the worker binary.
const HOST_SCRIPT: &str = include_str!("host.py");

/// Lines of the engine's stderr kept as its last words.
const TAIL_LINES: usize = 40;
/// How much of the tail goes into a crash's reason.
const WORDS_CHARS: usize = 1500;

/// What the engine is started with; engines with equal settings are the
/// same engine (kept warm across shards and jobs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSettings {
    pub python: PathBuf,
    pub model_dir: PathBuf,
    pub task: String,
    /// The engine arguments as JSON (sorted keys: serde_json's map).
    pub engine_args: String,
    /// `CUDA_VISIBLE_DEVICES` for the engine, when the worker's device is
    /// a GPU.
    pub cuda_device: Option<i64>,
}

/// What the host said once the engine was up.
#[derive(Debug, Clone, Deserialize)]
pub struct Ready {
    pub vllm: String,
    pub max_model_len: u64,
    pub engine_args: serde_json::Value,
}

/// A message from the host.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum HostMsg {
    Ready(Ready),
    Error {
        message: String,
    },
    Done {
        rid: String,
        #[serde(default)]
        text: Option<String>,
        #[serde(default)]
        prompt_tokens: u64,
        #[serde(default)]
        completion_tokens: Option<u64>,
        #[serde(default)]
        finish_reason: Option<String>,
        #[serde(default)]
        embedding: Option<Vec<f32>>,
        /// Prompt tokens vLLM's prefix cache already held.
        #[serde(default)]
        cached_tokens: u64,
    },
    Rejected {
        rid: String,
        reason: String,
    },
}

/// A request to the host.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum HostRequest {
    Generate {
        rid: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        messages: Option<serde_json::Value>,
        max_tokens: u64,
        temperature: f64,
        seed: u64,
    },
    Embed {
        rid: String,
        prompt: String,
    },
    /// Drop these requests (their batch will not be processed).
    Abort {
        rids: Vec<String>,
    },
}

/// What the feed's pump waits on: the messages of its engine (numbered by
/// the engine's generation, so a dead engine's last lines are told apart),
/// and wake-ups when there is more to send.
#[derive(Debug)]
pub(super) enum Event {
    Msg(u64, HostMsg),
    /// The engine of this generation closed its stdout: it is gone.
    Closed(u64),
    /// Work was queued, or a kill asked for.
    Wake,
}

/// A running engine.
pub struct Engine {
    settings: EngineSettings,
    child: Child,
    stdin: ChildStdin,
    /// Numbers this engine's events apart from an earlier one's.
    generation: u64,
    tail: Arc<Mutex<VecDeque<String>>>,
    pub ready: Ready,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("pid", &self.child.id())
            .field("settings", &self.settings)
            .finish()
    }
}

/// Why an engine stopped answering.
#[derive(Debug, Clone)]
pub struct Death {
    /// What is told of it: the exit status and the engine's last lines.
    pub words: String,
}

impl Engine {
    /// Starts an engine and waits until it is ready, or says why it could
    /// not start (the engine's own message). Its messages go to `events`
    /// as generation `generation`; `inbox` is where they arrive (wake-ups
    /// and older generations' messages that come meanwhile are dropped).
    pub(super) fn start(
        settings: &EngineSettings,
        generation: u64,
        events: &Sender<Event>,
        inbox: &Receiver<Event>,
    ) -> Result<Self, LlmError> {
        let script = host_script()?;
        let config = serde_json::json!({
            "model": settings.model_dir,
            "task": settings.task,
            "engine_args": serde_json::from_str::<serde_json::Value>(&settings.engine_args)
                .unwrap_or(serde_json::Value::Null),
        });
        let mut cmd = Command::new(&settings.python);
        cmd.arg(&script)
            .env("STOKE_LLM_CONFIG", config.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The engine is vLLM's process, with its own threads: stoke's
        // OpenMP wait settings for its own libtorch (`OPENMP_WAIT`, in this
        // process's environment unless the user set them) are not for it.
        for (name, value) in stoke_core::OPENMP_WAIT {
            if std::env::var(name).is_ok_and(|v| v == value) {
                cmd.env_remove(name);
            }
        }
        if let Some(gpu) = settings.cuda_device {
            cmd.env("CUDA_VISIBLE_DEVICES", gpu.to_string());
        }
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec and
        // only makes async-signal-safe calls (prctl, getppid, setpgid,
        // _exit).
        unsafe {
            cmd.pre_exec(move || {
                // Die with the worker (the thread that spawns is the
                // spawner thread, which lives as long as the process).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The worker died before the line above took effect.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                libc::setpgid(0, 0);
                Ok(())
            });
        }
        let mut child = spawn_from_long_lived_thread(cmd).map_err(|e| LlmError::Start {
            message: format!(
                "cannot run the engine's python {}: {e} (set [llm] python or STOKE_LLM_PYTHON to the python of a venv with vLLM)",
                settings.python.display()
            ),
        })?;
        let pid = child.id();
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(LlmError::Start {
                message: "the engine's pipes were not set up".into(),
            });
        };
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let kept = Arc::clone(&tail);
        std::thread::Builder::new()
            .name("stoke-llm-stderr".into())
            .spawn(move || read_stderr(stderr, kept, pid))
            .map_err(|e| LlmError::Start {
                message: format!("starting the engine's stderr reader: {e}"),
            })?;
        let events_tx = events.clone();
        std::thread::Builder::new()
            .name("stoke-llm-stdout".into())
            .spawn(move || read_stdout(stdout, events_tx, pid, generation))
            .map_err(|e| LlmError::Start {
                message: format!("starting the engine's stdout reader: {e}"),
            })?;
        info!(pid, python = %settings.python.display(), model = %settings.model_dir.display(), task = %settings.task, "engine starting");
        let mut engine = Self {
            settings: settings.clone(),
            child,
            stdin,
            generation,
            tail,
            ready: Ready {
                vllm: String::new(),
                max_model_len: 0,
                engine_args: serde_json::Value::Null,
            },
        };
        loop {
            match inbox.recv() {
                Ok(Event::Msg(g, _) | Event::Closed(g)) if g != generation => {}
                Ok(Event::Wake) => {}
                Ok(Event::Msg(_, HostMsg::Ready(ready))) => {
                    info!(pid, vllm = %ready.vllm, max_model_len = ready.max_model_len, engine_args = %ready.engine_args, "engine ready");
                    engine.ready = ready;
                    return Ok(engine);
                }
                Ok(Event::Msg(_, HostMsg::Error { message })) => {
                    engine.stop();
                    return Err(LlmError::Start { message });
                }
                Ok(Event::Msg(_, other)) => {
                    debug!(?other, "engine message before it was ready, ignored");
                }
                Ok(Event::Closed(_)) | Err(_) => {
                    let death = engine.death();
                    return Err(LlmError::Start {
                        message: format!("the engine exited while starting: {}", death.words),
                    });
                }
            }
        }
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Hands requests to the engine, in one write. A failed write means
    /// the engine is gone: its closed stdout (an [`Event::Closed`]) follows
    /// and says how.
    pub(super) fn send(&mut self, requests: &[HostRequest]) -> std::io::Result<()> {
        let mut lines = String::new();
        for request in requests {
            let line = serde_json::to_string(request).map_err(std::io::Error::other)?;
            lines.push_str(&line);
            lines.push('\n');
        }
        self.stdin
            .write_all(lines.as_bytes())
            .and_then(|()| self.stdin.flush())
    }

    /// The engine is gone: reap it and say how it ended, with its last
    /// lines.
    pub(super) fn death(&mut self) -> Death {
        // Its stdout closed: it exits (a Python error unwinds vLLM for a
        // moment), or is killed if it does not.
        let mut status = None;
        for _ in 0..50 {
            if let Ok(Some(s)) = self.child.try_wait() {
                status = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if status.is_none() {
            self.kill();
            status = self.child.wait().ok();
        }
        // The stderr reader may still be draining the last lines.
        std::thread::sleep(Duration::from_millis(100));
        let how = match status {
            Some(s) => match std::os::unix::process::ExitStatusExt::signal(&s) {
                Some(sig) => format!("engine process died (signal {sig}{})", signal_name(sig)),
                None => format!("engine process exited ({s})"),
            },
            None => "engine process stopped answering".to_string(),
        };
        let tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        let mut last: String = tail.iter().cloned().collect::<Vec<_>>().join("\n");
        if last.len() > WORDS_CHARS {
            let cut = last.len() - WORDS_CHARS;
            let cut = (cut..last.len())
                .find(|i| last.is_char_boundary(*i))
                .unwrap_or(0);
            last = format!("...{}", &last[cut..]);
        }
        Death {
            words: if last.is_empty() {
                how
            } else {
                format!("{how}; its last words: {last}")
            },
        }
    }

    pub(super) fn kill(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signals the engine's own process group (it called
        // setpgid(0, 0)), then the process itself in case it had not yet.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
    }

    /// Stops the engine (and anything it started) and reaps it.
    pub fn stop(&mut self) {
        self.kill();
        let _ = self.child.wait();
        info!(pid = self.child.id(), "engine stopped");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => ", SIGKILL",
        libc::SIGABRT => ", SIGABRT",
        libc::SIGSEGV => ", SIGSEGV",
        libc::SIGTERM => ", SIGTERM",
        libc::SIGBUS => ", SIGBUS",
        _ => "",
    }
}

fn read_stdout(
    stdout: std::process::ChildStdout,
    events: Sender<Event>,
    pid: u32,
    generation: u64,
) {
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<HostMsg>(&line) {
            Ok(msg) => {
                if events.send(Event::Msg(generation, msg)).is_err() {
                    return;
                }
            }
            Err(e) => warn!(pid, error = %e, %line, "engine said something that is not a message"),
        }
    }
    let _ = events.send(Event::Closed(generation));
}

fn read_stderr(stderr: std::process::ChildStderr, tail: Arc<Mutex<VecDeque<String>>>, pid: u32) {
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        debug!(target: "stoke_worker::llm::engine_log", pid, "{line}");
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
}

type SpawnJob = (Command, Sender<std::io::Result<Child>>);

/// Spawns `cmd` from a thread that lives as long as the process, so the
/// child's `PR_SET_PDEATHSIG` fires when the process dies, not when the
/// thread that asked for it ends.
fn spawn_from_long_lived_thread(cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<Sender<SpawnJob>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        let started = std::thread::Builder::new()
            .name("stoke-llm-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = started {
            warn!(error = %e, "no spawner thread for engines");
        }
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, reply_tx))
        .map_err(|_| std::io::Error::other("the engine spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("the engine spawner thread is gone"))?
}

/// The host script, written once per content under the stoke cache.
fn host_script() -> Result<PathBuf, LlmError> {
    use sha2::{Digest, Sha256};
    let hash = hex::encode(Sha256::digest(HOST_SCRIPT.as_bytes()));
    let dir = super::cache_root().join("llm");
    let path = dir.join(format!("host-{}.py", &hash[..16]));
    if path.is_file() {
        return Ok(path);
    }
    let fail = |e: std::io::Error| LlmError::Start {
        message: format!(
            "writing the engine host script under {}: {e}",
            dir.display()
        ),
    };
    std::fs::create_dir_all(&dir).map_err(fail)?;
    let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(fail)?;
    std::fs::write(tmp.path(), HOST_SCRIPT).map_err(fail)?;
    tmp.persist(&path).map_err(|e| fail(e.error))?;
    Ok(path)
}

/// Whether `path` looks like a Hugging Face model folder.
pub fn check_model_dir(path: &Path) -> Result<(), LlmError> {
    if !path.is_dir() {
        return Err(LlmError::Model {
            model: path.display().to_string(),
            message: "not found, or not a folder".into(),
        });
    }
    if !path.join("config.json").is_file() {
        return Err(LlmError::Model {
            model: path.display().to_string(),
            message: "not a Hugging Face model folder (it has no config.json)".into(),
        });
    }
    Ok(())
}
