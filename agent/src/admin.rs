//! The admin HTTP server: serves the metrics registry's exposition (GET /metrics, or any path)
//! and `/health` (answers `OK`) on `metrics_listen`. Apart from [`crate::metrics`], which only
//! names, describes and records metrics: the server needs the accept loop of [`crate::sys`], and
//! the accept loop records metrics, so the registry must not depend on the server.
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;

/// Serves `handle` on `listener` from a spawned task, with the `process_*` metrics (CPU, RSS,
/// open and max fds, threads, start time: the names every Prometheus client exports and
/// dashboards expect) refreshed on each scrape. The caller binds the listener, so
/// `metrics_listen` may name port 0 and the agent reports the port it got. Must run inside a
/// tokio runtime, after [`crate::metrics::install`].
pub fn spawn(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    let process = metrics_process::Collector::default();
    process.describe();
    tokio::spawn(serve(listener, handle, process));
}

/// The HTTP/1 scrape endpoint: every accepted connection gets the text exposition format.
async fn serve(listener: tokio::net::TcpListener, handle: PrometheusHandle, process: metrics_process::Collector) {
    let cap = crate::sys::probe_cap(crate::sys::nofile());
    let limit = crate::sys::ConnLimit::new("metrics", cap);
    let mut incoming = Box::pin(crate::sys::incoming_with_backoff(listener, "metrics", limit));
    while let Some(Ok(stream)) = incoming.next().await {
        let (handle, process) = (handle.clone(), process.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (handle, process) = (handle.clone(), process.clone());
                async move {
                    let (body, content_type) = if req.uri().path() == "/health" {
                        ("OK".to_string(), "text/plain")
                    } else {
                        // Reading /proc/self is file IO: on the blocking pool, with the render.
                        let render = move || {
                            process.collect();
                            handle.render()
                        };
                        (tokio::task::spawn_blocking(render).await.unwrap_or_default(), "text/plain")
                    };
                    let mut response = hyper::Response::new(http_body_util::Full::new(bytes::Bytes::from(body)));
                    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await {
                tracing::debug!(error = %e, "metrics connection ended with an error");
            }
        });
    }
}
