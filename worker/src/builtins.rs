//! The stock worker's built-in processors, by the names job specs use.
//! This module depends on the processors and the registry; neither depends
//! on it, so a processor module never needs the registry that lists it.

use crate::llm::{self, LlmProcessor};
use crate::processor::Registry;
use crate::pytorch::{self, PyTorchProcessor};

impl Registry {
    /// The stock worker's processors: `pytorch` (TorchScript files and
    /// `.pt2` packages), its alias `torchscript`, and `llm` (prompts
    /// through a vLLM engine in its own process).
    pub fn with_builtins() -> Self {
        let mut r = Self::new();
        r.register::<PyTorchProcessor>(pytorch::NAME);
        r.register::<PyTorchProcessor>(pytorch::ALIAS);
        r.register_dyn(llm::NAME, LlmProcessor::create);
        r
    }
}
