//! What the engine itself refuses. Errors the driver feeds in (a failed lease, a refused grant)
//! are the driver's own type, carried through the session unchanged as its `E`.
use crate::range::RangeError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The peer's grant, or the transfer's length, cannot carry the transfer.
    #[error("{0}")]
    Invalid(String),
    /// The transfer's range does not fit its local region.
    #[error(transparent)]
    Range(#[from] RangeError),
}
