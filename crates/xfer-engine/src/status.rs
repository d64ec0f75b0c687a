//! Work-completion status: what became of one work request, in `ibv_wc_status` terms so both
//! fabrics (and the failure codes built from them) report failures alike.
use std::fmt;

/// Work-completion status, mirroring `ibv_wc_status` so both fabrics report failures alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocProtErr,
    WrFlushErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    GeneralErr,
    /// A status value this build does not know (never panics on device input).
    Other(u32),
}

impl WcStatus {
    /// The verbs-style name used in errors and metrics (`REM_ACCESS_ERR`, ...).
    pub fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "SUCCESS",
            WcStatus::LocLenErr => "LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "LOC_PROT_ERR",
            WcStatus::WrFlushErr => "WR_FLUSH_ERR",
            WcStatus::RemInvReqErr => "REM_INV_REQ_ERR",
            WcStatus::RemAccessErr => "REM_ACCESS_ERR",
            WcStatus::RemOpErr => "REM_OP_ERR",
            WcStatus::RetryExcErr => "RETRY_EXC_ERR",
            WcStatus::RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            WcStatus::GeneralErr => "GENERAL_ERR",
            WcStatus::Other(_) => "OTHER_ERR",
        }
    }

    /// Wire code for the TCP fabric (the `ibv_wc_status` numbering).
    pub fn code(self) -> u16 {
        match self {
            WcStatus::Success => 0,
            WcStatus::LocLenErr => 1,
            WcStatus::LocQpOpErr => 2,
            WcStatus::LocProtErr => 4,
            WcStatus::WrFlushErr => 5,
            WcStatus::RemInvReqErr => 9,
            WcStatus::RemAccessErr => 10,
            WcStatus::RemOpErr => 11,
            WcStatus::RetryExcErr => 12,
            WcStatus::RnrRetryExcErr => 13,
            WcStatus::GeneralErr => 21,
            WcStatus::Other(v) => v.min(u16::MAX as u32) as u16,
        }
    }

    pub fn from_code(code: u32) -> WcStatus {
        match code {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            21 => WcStatus::GeneralErr,
            v => WcStatus::Other(v),
        }
    }

    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }

    /// True when the error says the *path* failed, so the same work request could succeed on
    /// another path (another QP pair, through other devices): the peer did not answer
    /// (`RETRY_EXC_ERR`, and the unnamed `RESP_TIMEOUT_ERR`), the QP was moved to error under it
    /// (`WR_FLUSH_ERR`), the local QP or device broke (`LOC_QP_OP_ERR`, `GENERAL_ERR`, the
    /// unnamed `FATAL_ERR`) or a response came back garbled (`BAD_RESP_ERR`). False for what any
    /// path would meet again: access, protection, length and operation errors name the grant or
    /// the request, not the link; and `RNR_RETRY_EXC_ERR` says the peer posted no receive, which
    /// is the peer's, not the path's. A status this build does not know is not a path failure:
    /// failing the transfer with its code says more than re-posting it everywhere.
    pub fn is_path_failure(self) -> bool {
        match self {
            WcStatus::RetryExcErr | WcStatus::WrFlushErr | WcStatus::LocQpOpErr | WcStatus::GeneralErr => true,
            // ibv_wc_status: 7 BAD_RESP_ERR, 19 FATAL_ERR, 20 RESP_TIMEOUT_ERR.
            WcStatus::Other(7 | 19 | 20) => true,
            WcStatus::Success
            | WcStatus::LocLenErr
            | WcStatus::LocProtErr
            | WcStatus::RemInvReqErr
            | WcStatus::RemAccessErr
            | WcStatus::RemOpErr
            | WcStatus::RnrRetryExcErr
            | WcStatus::Other(_) => false,
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which completion errors another path could succeed at, status by status (the whole
    /// `ibv_wc_status` numbering, so a status added to the enum later is decided here too).
    #[test]
    fn path_failures_are_the_link_and_qp_errors_only() {
        let path: Vec<u32> = (0..=32).filter(|&c| WcStatus::from_code(c).is_path_failure()).collect();
        // RETRY_EXC, WR_FLUSH, LOC_QP_OP, GENERAL; BAD_RESP, FATAL, RESP_TIMEOUT.
        assert_eq!(path, vec![2, 5, 7, 12, 19, 20, 21]);
        for s in [WcStatus::RetryExcErr, WcStatus::WrFlushErr, WcStatus::LocQpOpErr, WcStatus::GeneralErr] {
            assert!(s.is_path_failure(), "{s}");
        }
        for s in [
            WcStatus::Success,
            WcStatus::LocLenErr,
            WcStatus::LocProtErr,
            WcStatus::RemInvReqErr,
            WcStatus::RemAccessErr,
            WcStatus::RemOpErr,
            WcStatus::RnrRetryExcErr,
            WcStatus::Other(6),  // MW_BIND_ERR
            WcStatus::Other(8),  // LOC_ACCESS_ERR
            WcStatus::Other(15), // REM_INV_RD_REQ_ERR
            WcStatus::Other(16), // REM_ABORT_ERR
            WcStatus::Other(999),
        ] {
            assert!(!s.is_path_failure(), "{s}");
        }
    }
}
