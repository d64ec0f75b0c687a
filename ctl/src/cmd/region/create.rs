//! `xferctl region create NAME --size SIZE ...`.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use xfer_client::{Access, RegionKind, RegionSpec};

use super::parse_label;
use crate::units::{parse_duration, parse_size};
use crate::view;
use crate::Ctx;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Kind {
    /// Agent-allocated, zeroed memory.
    Anonymous,
    /// A regular file under the agent's `regions.file_roots` mapped shared (`--path`, relative
    /// to the first root or absolute inside one); persists across restarts.
    File,
    /// A POSIX shared-memory object under /dev/shm (`--path` = object name).
    Shm,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum AccessArg {
    /// Peers may READ from and WRITE into the region.
    Rw,
    /// Peers may only READ from the region.
    R,
    /// Peers may only WRITE into the region.
    W,
}

#[derive(Debug, Args)]
pub struct Opt {
    /// Region name (unique per agent).
    pub name: String,
    /// Length, e.g. 4096, 64MiB, 1GiB (binary units; 1GB is 10^9 bytes). Kind file: defaults to
    /// the existing file's size.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    #[arg(long, value_enum, default_value = "anonymous")]
    pub kind: Kind,
    /// File path (kind file) or shm object name (kind shm).
    #[arg(long)]
    pub path: Option<String>,
    /// Access ceiling for remote peers.
    #[arg(long, value_enum, default_value = "rw")]
    pub access: AccessArg,
    /// Lease: the region is deregistered after this long (e.g. 10m, 1h).
    #[arg(long, value_parser = parse_duration)]
    pub ttl: Option<Duration>,
    /// Label key=value (repeatable).
    #[arg(long = "label", value_parser = parse_label, value_name = "K=V")]
    pub labels: Vec<(String, String)>,
    /// Back anonymous memory with huge pages.
    #[arg(long)]
    pub hugepages: bool,
    /// Kind shm: use an object that already exists (owned by the agent's uid or the agent's
    /// `regions.shm_owner`, at least --size long; never resized nor removed by the agent).
    #[arg(long)]
    pub adopt: bool,
    /// Kind file: create the file under the agent's file root with --size zero bytes (its
    /// directory must exist; an existing file is refused, never replaced).
    #[arg(long)]
    pub create: bool,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    if opt.adopt && !matches!(opt.kind, Kind::Shm) {
        return Err(crate::error::usage("--adopt applies to --kind shm only"));
    }
    if matches!(opt.kind, Kind::File) && opt.path.is_none() {
        // Usage-level mistake, but only detectable after parsing: say so plainly.
        return Err(crate::error::usage("--kind file needs --path PATH (a file beneath the agent's regions.file_roots)"));
    }
    if opt.create && !matches!(opt.kind, Kind::File) {
        return Err(crate::error::usage("--create applies to --kind file only"));
    }
    let size = match (opt.size, opt.kind) {
        (Some(n), _) => n,
        (None, Kind::File) if opt.create => return Err(crate::error::usage("--create needs --size: the length of the new file")),
        // 0: the agent takes the existing file's size.
        (None, Kind::File) => 0,
        (None, _) => return Err(crate::error::usage("--size SIZE is required (e.g. 64MiB)")),
    };
    let spec = RegionSpec {
        name: opt.name.clone(),
        length: size,
        kind: match opt.kind {
            Kind::Anonymous => RegionKind::Anonymous,
            Kind::File => RegionKind::File,
            Kind::Shm => RegionKind::Shm,
        },
        path: opt.path.unwrap_or_default(),
        access: match opt.access {
            AccessArg::Rw => Access::ReadWrite,
            AccessArg::R => Access::Read,
            AccessArg::W => Access::Write,
        },
        hugepages: opt.hugepages,
        ttl: opt.ttl,
        labels: opt.labels.into_iter().collect(),
        adopt_existing: opt.adopt,
        create_file: opt.create,
    };
    let client = ctx.client().await?;
    let region = client.create(spec).await.with_context(|| format!("creating region {:?}", opt.name))?;
    if ctx.json {
        ctx.print_json(&view::region_json(&region))
    } else {
        ctx.print(&view::region_table(std::slice::from_ref(&region)))
    }
}
