//! Regions on the wire: `CreateRegion` into a [`RegionSpec`], a region (live, or a catalog entry
//! that could not be restored) into `pb::Region`, and the answers of the region calls.
use tonic::Status;
use xfer_proto::v1 as pb;

use super::scalars::{access_from_pb, access_to_pb, algo_to_pb, kind_from_pb, kind_to_pb, request_duration, time_to_pb};
use crate::checksum::Algo;
use crate::regions::{Region, RegionSpec, RegionView, UnavailableRegion};

pub fn region_to_pb(r: &Region) -> pb::Region {
    let exposed = r.registration.remote_key_exposed();
    pb::Region {
        id: r.id.clone(),
        name: r.name.clone(),
        length: r.length,
        kind: kind_to_pb(r.kind) as i32,
        path: r.path.clone().unwrap_or_default(),
        access: access_to_pb(r.access) as i32,
        labels: r.labels.clone().into_iter().collect(),
        created_at: Some(time_to_pb(r.created_at)),
        expires_at: r.expires_at.map(time_to_pb),
        // Keys and the registered address only where they are the region's remote access
        // anyway (verbs grant mode `region`); otherwise only grants expose memory.
        lkey: if exposed { r.registration.lkey() } else { 0 },
        rkey: if exposed { r.registration.rkey() } else { 0 },
        addr: if exposed { r.registration.addr() } else { 0 },
        // A region whose file shrank under its mapping stays listed (delete it to recreate).
        unavailable_reason: match r.intact() {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        },
    }
}

/// A catalog region that could not be restored: what the catalog says, no keys, and the reason.
pub fn unavailable_region_to_pb(u: &UnavailableRegion) -> pb::Region {
    pb::Region {
        id: u.id().to_string(),
        name: u.name().to_string(),
        length: u.length(),
        kind: kind_to_pb(u.kind()) as i32,
        path: u.path().unwrap_or_default().to_string(),
        access: access_to_pb(u.access()) as i32,
        labels: u.labels().clone().into_iter().collect(),
        created_at: Some(time_to_pb(u.created_at())),
        expires_at: u.expires_at().map(time_to_pb),
        lkey: 0,
        rkey: 0,
        addr: 0,
        unavailable_reason: u.reason.clone(),
    }
}

pub fn region_view_to_pb(v: &RegionView) -> pb::Region {
    match v {
        RegionView::Live(r) => region_to_pb(r),
        RegionView::Unavailable(u) => unavailable_region_to_pb(u),
    }
}

/// `Agent.ListRegions`' answer.
pub fn region_list_to_pb(regions: &[RegionView]) -> pb::ListRegionsResponse {
    pb::ListRegionsResponse { regions: regions.iter().map(region_view_to_pb).collect() }
}

/// `Agent.WriteRegion`'s answer: how many bytes the stream stored.
pub fn region_written_to_pb(bytes_written: u64) -> pb::WriteRegionResponse {
    pb::WriteRegionResponse { bytes_written }
}

/// One piece of `Agent.ReadRegion`'s stream: `data` read at `offset`.
pub fn region_piece_to_pb(offset: u64, data: Vec<u8>) -> pb::ReadRegionResponse {
    pb::ReadRegionResponse { offset, data }
}

/// `Agent.Checksum`'s answer.
pub fn checksum_to_pb(algo: Algo, value: u64) -> pb::ChecksumResponse {
    pb::ChecksumResponse { algo: algo_to_pb(algo) as i32, value }
}

/// `Agent.CreateRegion`: everything that can be checked without the registry.
pub fn region_spec_from_pb(r: pb::CreateRegionRequest) -> Result<RegionSpec, Status> {
    Ok(RegionSpec {
        ttl: request_duration(r.ttl.as_ref(), "ttl")?.filter(|d| !d.is_zero()),
        kind: kind_from_pb(r.kind)?,
        access: access_from_pb(r.access)?,
        name: r.name,
        length: r.length,
        path: Some(r.path).filter(|p| !p.is_empty()),
        hugepages: r.hugepages,
        labels: r.labels.into_iter().collect(),
        adopt_existing: r.adopt_existing,
        create_file: r.create_file,
        shares: None,
    })
}
