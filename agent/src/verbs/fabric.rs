//! [`VerbsFabric`]: the `Fabric` trait over RC QPs.
use std::sync::Arc;

use async_trait::async_trait;

use super::connection::{ConnInner, VerbsAccepted, VerbsPending};
use super::device::Device;
use super::memory::RegionMemory;
use super::mr::{self, GrantMr, VerbsRegistration};
use super::{negotiate, VerbsOptions};
use crate::fabric::{
    Access, Accepted, CompletionSink, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, FabricInfo, FabricKind,
    GrantMode, PendingConnection, Registration, RemoteKey, RemoteOp,
};
use sideway::ibverbs::AccessFlags;

/// The verbs data plane: one device context and PD shared by every registration and connection.
pub struct VerbsFabric {
    dev: Arc<Device>,
    opts: VerbsOptions,
}

impl std::fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsFabric").field("dev", &self.dev).finish()
    }
}

impl VerbsFabric {
    /// Opens the device and port `opts` select and picks the GID (see [`VerbsOptions`]).
    pub fn open(opts: VerbsOptions) -> Result<VerbsFabric, FabricError> {
        opts.validate()?;
        let dev = Device::open(&opts)?;
        Ok(VerbsFabric { dev: Arc::new(dev), opts })
    }

    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    pub fn gid_index(&self) -> u32 {
        self.dev.gid_index
    }

    /// Finds our own registration behind a trait object (for grant MRs over its memory).
    fn ours(reg: &Arc<dyn Registration>) -> Result<(), FabricError> {
        if reg.lkey() == 0 && reg.rkey() == 0 {
            return Err(FabricError::Registration("registration does not belong to the verbs fabric".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl Fabric for VerbsFabric {
    fn kind(&self) -> FabricKind {
        FabricKind::Verbs
    }

    fn info(&self) -> FabricInfo {
        FabricInfo { kind: FabricKind::Verbs, devices: vec![self.dev.info()], data_address: None }
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(VerbsRegistration::new(&self.dev.pd, memory, access)?))
    }

    fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        Self::ours(reg)?;
        let memory = reg.memory();
        memory.check(req.offset, req.len).map_err(|e| FabricError::LocalRange(e.to_string()))?;
        if req.len == 0 {
            return Err(FabricError::LocalRange("cannot expose an empty range".into()));
        }
        if !reg.access().allows(req.op) {
            return Err(FabricError::Registration(format!(
                "region access ceiling {} does not allow remote {}",
                reg.access(),
                req.op
            )));
        }
        let addr = reg.addr() + req.offset;
        match req.mode {
            GrantMode::Region => Ok(Exposure { addr, key: RemoteKey::Rkey(reg.rkey()), keepalive: None }),
            GrantMode::Mr => {
                let flags = match req.op {
                    RemoteOp::Read => AccessFlags::RemoteRead,
                    RemoteOp::Write => {
                        if !memory.writable() {
                            return Err(FabricError::Registration("remote write to read-only memory".into()));
                        }
                        AccessFlags::RemoteWrite | AccessFlags::LocalWrite
                    }
                };
                let grant_mr = mr::reg(&self.dev.pd, memory, req.offset, req.len, flags)?;
                let key = RemoteKey::Rkey(grant_mr.rkey());
                let keep = GrantMr { _mr: grant_mr, _memory: Arc::clone(memory) };
                Ok(Exposure { addr, key, keepalive: Some(Box::new(keep)) })
            }
            GrantMode::Mw => Err(FabricError::Other(
                "grant mode mw (type-2 memory windows) is not implemented by the verbs fabric yet; use mr or region"
                    .into(),
            )),
        }
    }

    async fn prepare(
        &self,
        peer: &str,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        let inner = ConnInner::build(&self.dev, &self.opts, peer, qps, depth, true)?;
        Ok(Box::new(VerbsPending { inner, dev: Arc::clone(&self.dev), opts: self.opts.clone(), sink }))
    }

    async fn accept(&self, peer: &str, remote: &[Endpoint]) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        // Validate before allocating anything for the peer.
        negotiate::validate_remote(&self.dev.local_port(), remote, None)?;
        // The responder posts nothing: a small send queue and no completion channel.
        let inner = ConnInner::build(&self.dev, &self.opts, peer, remote.len(), 1, false)?;
        inner.connect(&self.dev, &self.opts, remote)?;
        let eps = inner.endpoints(&self.dev);
        Ok((eps, Box::new(VerbsAccepted::new(inner))))
    }
}
