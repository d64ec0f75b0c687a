//! Protobuf ⇄ domain conversions: the one proto boundary, one file per domain, and the mapping
//! of every domain error to a gRPC status (`status`, the only place a `tonic::Status` is
//! built). Handlers check a request's bounds, call the node in domain types, and convert the
//! answer with a function from here (an answer with no fields is its `Default`); the peer client
//! builds its requests and reads their answers here too (`calls`). Callers use the flat surface
//! re-exported below.
mod bench;
mod calls;
mod info;
mod peers;
mod regions;
mod scalars;
mod status;
mod transfers;

pub use bench::{bench_params_from_pb, bench_region_to_pb, bench_to_pb, sink_to_pb, tcp_baseline_to_pb};
pub use calls::{
    announce_request_to_pb, bench_region_request_to_pb, close_bench_region_request_to_pb, complete_request_to_pb, disconnect_request_to_pb,
    grant_info_from_pb, grant_request_to_pb, handshake_reply_from_pb, peer_connect_request_to_pb, revoke_request_to_pb, sink_request_to_pb,
    verify_batch_request_to_pb,
};
pub use info::agent_info_to_pb;
pub use peers::{
    complete_to_pb, connection_id_from_pb, endpoint_from_pb, endpoint_to_pb, grant_params_from_pb, grant_to_pb, peer_address,
    peer_connect_from_pb, peer_connect_to_pb, peer_info_to_pb, peer_list_to_pb, spans_from_pb, verify_batch_to_pb,
};
pub use regions::{
    checksum_to_pb, region_list_to_pb, region_piece_to_pb, region_spec_from_pb, region_to_pb, region_view_to_pb, region_written_to_pb,
    unavailable_region_to_pb,
};
pub use scalars::{
    access_from_pb, access_to_pb, algo_from_pb, algo_to_pb, duration_from_pb, duration_to_pb, fabric_from_pb, fabric_to_pb, kind_from_pb,
    op_from_pb, time_from_pb, time_to_pb, MAX_DURATION,
};
pub use status::{
    auth_status, bound_status, fabric_status, grant_status, lagged_status, peer_status, region_status, ring_failed_status, transfer_status,
};
pub(crate) use status::{invalid, join_status, require};
pub use transfers::{
    channel_input_from_pb, channel_open_from_pb, channel_opened_to_pb, channel_output_to_pb, channel_params_from_pb, inbound_ring_to_pb,
    notification_to_pb, transfer_list_to_pb, transfer_request_from_pb, transfer_to_pb,
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};
    use xfer_proto::v1 as pb;

    /// A ttl/timeout of ~i64::MAX seconds used to be accepted, then `SystemTime::now() + ttl`
    /// (regions) / `Instant::now() + timeout` (submit) panicked. The request_validation fuzz
    /// target's deadline invariant catches it (fuzz/corpus/request_validation/seed-regress-huge-ttl).
    #[test]
    fn huge_durations_are_rejected_before_they_become_deadlines() {
        let huge = prost_types::Duration { seconds: i64::MAX, nanos: 0 };
        assert_eq!(duration_from_pb(&huge), None);
        let max = duration_to_pb(MAX_DURATION);
        let d = duration_from_pb(&max).unwrap();
        assert!(SystemTime::now().checked_add(d).is_some());
        assert!(std::time::Instant::now().checked_add(d + Duration::from_secs(60)).is_some());

        let region = pb::CreateRegionRequest { name: "r".into(), length: 1, ttl: Some(huge), ..Default::default() };
        let err = region_spec_from_pb(region).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("ttl"), "{}", err.message());
        let submit = pb::SubmitTransferRequest {
            op: pb::Op::Write as i32,
            local: Some(pb::LocalRange { region: "a".into(), offset: 0 }),
            remote: Some(pb::RemoteRange { agent: "h:1".into(), region: "b".into(), offset: 0 }),
            options: Some(pb::TransferOptions { timeout: Some(huge), ..Default::default() }),
            ..Default::default()
        };
        assert!(transfer_request_from_pb(submit).unwrap_err().message().contains("timeout"));
        let grant = pb::GrantRequest {
            region: "b".into(),
            node_name: "n".into(),
            op: pb::Access::Write as i32,
            ttl: Some(huge),
            ..Default::default()
        };
        assert!(grant_params_from_pb(grant).is_err());
    }
}
