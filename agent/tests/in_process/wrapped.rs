//! A fabric that is another one in everything but the connections it makes, which a test wraps
//! (a path that lies, a connection flushed whole): the delegation of the fabric and of its
//! pending connections written once.
use std::sync::Arc;

use async_trait::async_trait;
use xfer_engine::ids::ConnectionId;
use xfer_fabric::{CompletionSink, Connection, Endpoint, Fabric, FabricError, FabricKind, PendingConnection};

/// Wraps one established connection of the inner fabric.
pub(crate) type WrapConn = Box<dyn FnOnce(Arc<dyn Connection>) -> Arc<dyn Connection> + Send>;

/// Called when a connection is prepared (with its completion sink and QP count): how the test
/// wraps that connection once it is established.
pub(crate) type WrapPending = dyn Fn(CompletionSink, usize) -> WrapConn + Send + Sync;

pub(crate) struct Wrapped {
    pub(crate) inner: Arc<dyn Fabric>,
    pub(crate) wrap: Box<WrapPending>,
}

#[async_trait]
impl Fabric for Wrapped {
    fn kind(&self) -> FabricKind {
        self.inner.kind()
    }
    fn grants_need_connection(&self) -> bool {
        self.inner.grants_need_connection()
    }
    fn info(&self) -> xfer_fabric::FabricInfo {
        self.inner.info()
    }
    fn register(
        &self,
        memory: Arc<xfer_rdma::memory::RegionMemory>,
        access: xfer_fabric::Access,
    ) -> Result<Arc<dyn xfer_fabric::Registration>, FabricError> {
        self.inner.register(memory, access)
    }
    async fn expose(
        &self,
        reg: &Arc<dyn xfer_fabric::Registration>,
        req: &xfer_fabric::ExposeRequest,
    ) -> Result<xfer_fabric::Exposure, FabricError> {
        self.inner.expose(reg, req).await
    }
    async fn prepare(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        let pending = self.inner.prepare(peer, connection_id, qps, depth, sink.clone()).await?;
        Ok(Box::new(WrappedPending { pending, wrap: (self.wrap)(sink, qps) }))
    }
    async fn accept(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn xfer_fabric::Accepted>), FabricError> {
        self.inner.accept(peer, connection_id, remote).await
    }
}

struct WrappedPending {
    pending: Box<dyn PendingConnection>,
    wrap: WrapConn,
}

#[async_trait]
impl PendingConnection for WrappedPending {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        self.pending.local_endpoints()
    }
    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let conn = self.pending.complete(remote).await?;
        Ok((self.wrap)(conn))
    }
}
