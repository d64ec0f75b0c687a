//! [`VerbsError`]: what the raw verbs objects of this crate report. The agent converts it into its
//! `FabricError` (one variant each), so the messages users see are unchanged. No `unsafe` here;
//! the error type lives in this crate so the wrappers need nothing from the agent.
use std::io;

#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// Creating a connection's verbs objects failed (reported like a negotiation step).
    #[error("{step}: {attr}: {detail}")]
    Setup { step: &'static str, attr: &'static str, detail: String },
    /// A memory registration or memory window could not be made.
    #[error("{0}")]
    Registration(String),
    /// A work request's local range is outside its memory or registration.
    #[error("{0}")]
    LocalRange(String),
    /// The device, the provider or the queue refused the operation.
    #[error("{0}")]
    Other(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}
