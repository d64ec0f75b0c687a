//! Vocabulary shared by the agent and xferctl, so both read the same text the same way: byte
//! sizes ([`size`]), durations ([`duration`]) and facts about the host process ([`host`]).
#![forbid(unsafe_code)]

pub mod duration;
pub mod host;
pub mod size;

pub use duration::{parse_duration, HumanDuration};
pub use size::{format_bytes, format_size_compact, parse_size, ByteSize};
