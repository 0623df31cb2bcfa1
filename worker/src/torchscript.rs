//! The processor's earlier name: `torchscript` is an alias of the built-in
//! [`pytorch`](crate::pytorch) processor, which loads TorchScript files as
//! before (and `.pt2` packages too).

/// The alias job specs may still use.
pub const NAME: &str = crate::pytorch::ALIAS;

/// The same processor under its earlier type name.
pub type TorchScriptProcessor = crate::pytorch::PyTorchProcessor;
