//! Vocabulary shared by the agent and xferctl, so both read the same text the same way: byte
//! sizes ([`size`]), durations ([`duration`]), configuration words ([`words`]) and facts about the
//! host process ([`host`]), and deadlines that never overflow ([`deadline`]).
#![forbid(unsafe_code)]

pub mod deadline;
pub mod duration;
pub mod host;
pub mod size;
pub mod words;

pub use duration::{parse_duration, HumanDuration};
pub use size::{format_bytes, format_size_compact, parse_size, ByteSize};
pub use words::one_of;
