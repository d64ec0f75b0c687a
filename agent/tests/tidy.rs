//! Tidy: architecture invariants that the compiler does not check, checked over the source tree
//! (rust-analyzer's `tidy.rs` style). Each test names the invariant from ARCHITECTURE.md it
//! enforces and prints every offending `file:line`, so a failure says what to fix.
// A tidy check that cannot read the tree has nothing better to do than fail.
#![allow(clippy::expect_used)]
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("agent/ has a parent").to_path_buf()
}

/// Every `.rs` file of the product (not tests, benches, fuzz targets or build output).
fn product_sources() -> Vec<(PathBuf, String)> {
    let root = workspace_root();
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = ["agent/src", "ctl/src", "proto/src", "crates"].iter().map(|d| root.join(d)).collect();
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if p.is_dir() {
                if !matches!(name, "target" | "tests" | "benches") {
                    stack.push(p);
                }
            } else if name.ends_with(".rs") {
                // `foo/tests.rs` is the body of a `#[cfg(test)] mod tests;` in `foo.rs` (checked
                // below): test code, like the part of a file after its `#[cfg(test)]`.
                if name == "tests.rs" && test_module_file(&p) {
                    continue;
                }
                let text = std::fs::read_to_string(&p).expect("read source");
                out.push((p.strip_prefix(&root).unwrap_or(&p).to_path_buf(), text));
            }
        }
    }
    out.sort();
    assert!(out.len() > 20, "tidy found only {} source files under {}", out.len(), root.display());
    out
}

/// The lines of `text` outside `#[cfg(test)] mod tests { … }` (unit tests may do what product
/// code may not). A test module is taken to run to the end of the file, as ours do.
/// True if `path` (`…/foo/tests.rs`) is declared by its parent `…/foo.rs` as `#[cfg(test)]
/// mod tests;`.
fn test_module_file(path: &std::path::Path) -> bool {
    let Some(dir) = path.parent() else { return false };
    let parent = dir.with_extension("rs");
    let Ok(text) = std::fs::read_to_string(parent) else { return false };
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines.windows(2).any(|w| w[0] == "#[cfg(test)]" && w[1] == "mod tests;")
}

fn product_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let end = text.lines().position(|l| l.trim() == "#[cfg(test)]").unwrap_or(usize::MAX);
    text.lines().enumerate().take_while(move |(i, _)| *i < end).map(|(i, l)| (i + 1, l))
}

fn fail_if_any(what: &str, offenders: Vec<String>) {
    assert!(offenders.is_empty(), "{what}:\n  {}", offenders.join("\n  "));
}

/// The one crate allowed to contain `unsafe` (issue 10, bullet 1).
const UNSAFE_CRATE: &str = "crates/xfer-rdma/";
/// Where region memory lives, the only file that may build slices over raw pointers.
const REGION_MEMORY: &str = "crates/xfer-rdma/src/memory.rs";

/// Every `.rs` file under `dirs` (relative to the workspace root), build output excluded.
fn sources_under(dirs: &[&str]) -> Vec<(PathBuf, String)> {
    let root = workspace_root();
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = dirs.iter().map(|d| root.join(d)).collect();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            let Ok(rd) = std::fs::read_dir(&p) else { continue };
            for e in rd.flatten() {
                if e.file_name() != "target" {
                    stack.push(e.path());
                }
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).expect("read source");
            out.push((p.strip_prefix(&root).unwrap_or(&p).to_path_buf(), text));
        }
    }
    out.sort();
    out
}

/// One unsafe crate: no `unsafe` anywhere outside `crates/xfer-rdma` — product code, unit and
/// integration tests, build scripts and fuzz targets — and every other crate root is
/// `#![forbid(unsafe_code)]`, so the compiler keeps it that way.
#[test]
fn unsafe_lives_only_in_the_rdma_crate() {
    let mut bad = Vec::new();
    let dirs = ["agent", "ctl", "proto", "crates", "fuzz/fuzz_targets"];
    for (path, text) in sources_under(&dirs) {
        let p = path.to_string_lossy();
        if p.starts_with(UNSAFE_CRATE) || p == "agent/tests/tidy.rs" {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let words = code.split(|c: char| !(c.is_alphanumeric() || c == '_'));
            if words.into_iter().any(|w| w == "unsafe") {
                bad.push(format!("{p}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    let roots = [
        "agent/src/lib.rs",
        "agent/src/main.rs",
        "ctl/src/lib.rs",
        "ctl/src/main.rs",
        "proto/src/lib.rs",
        "proto/build.rs",
        "crates/xfer-common/src/lib.rs",
        "crates/xfer-engine/src/lib.rs",
        "crates/xfer-client/src/lib.rs",
    ];
    for root in roots {
        let text = std::fs::read_to_string(workspace_root().join(root)).expect("read crate root");
        if !text.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]") {
            bad.push(format!("{root}: crate root without #![forbid(unsafe_code)]"));
        }
    }
    // A new crate must be added to `roots` (or be the unsafe crate).
    for (path, _) in sources_under(&["crates"]) {
        let p = path.to_string_lossy().into_owned();
        if p.ends_with("/src/lib.rs") && !p.starts_with(UNSAFE_CRATE) && !roots.contains(&p.as_str()) {
            bad.push(format!("{p}: crate root not checked for #![forbid(unsafe_code)] (add it to tidy)"));
        }
    }
    fail_if_any("unsafe outside crates/xfer-rdma", bad);
}

/// Region memory is shared with the NIC, peers and other processes, so no safe function may hand
/// it out as a Rust reference: `RegionMemory`'s public API returns no `&[u8]`/`&mut [u8]`, and
/// slices over raw pointers are built only in the region-memory module (issue 9, bullet 8).
#[test]
fn region_memory_is_never_handed_out_as_a_slice() {
    let mut bad = Vec::new();
    let memory = product_sources().into_iter().filter(|(p, _)| p.ends_with(REGION_MEMORY)).count();
    assert_eq!(memory, 1, "{REGION_MEMORY} not found: update tidy");
    for (path, text) in product_sources() {
        let is_memory = path.ends_with(REGION_MEMORY);
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            if is_memory
                && code.contains("pub fn")
                && (code.contains("-> &[u8]") || code.contains("&mut [u8]>") || code.contains("-> &mut [u8]") || code.contains("Result<&"))
            {
                bad.push(format!("{}:{n}: public accessor returns a reference into region memory: {}", path.display(), line.trim()));
            }
            if !is_memory && (code.contains("from_raw_parts") || code.contains("slice_mut(")) {
                bad.push(format!("{}:{n}: slice over raw memory outside {REGION_MEMORY}: {}", path.display(), line.trim()));
            }
        }
    }
    fail_if_any("region memory leaves its module as a slice", bad);
}

/// Every `unsafe` block, impl and fn carries a `// SAFETY:` comment (or, for an `unsafe fn`, a
/// `# Safety` doc section) on one of the lines just above it. Checked over the whole of
/// `crates/xfer-rdma`, unit tests included (product code elsewhere has no `unsafe` at all).
#[test]
fn every_unsafe_has_a_safety_comment() {
    let mut bad = Vec::new();
    let unsafe_crate = sources_under(&[UNSAFE_CRATE]);
    assert!(unsafe_crate.len() >= 5, "tidy found only {} files under {UNSAFE_CRATE}", unsafe_crate.len());
    for (path, text) in unsafe_crate {
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate().map(|(i, l)| (i + 1, *l)) {
            let code = line.split("//").next().unwrap_or("");
            let opens =
                code.contains("unsafe {") || code.contains("unsafe impl") || code.contains("unsafe fn") || code.contains("unsafe extern");
            if !opens || code.contains("#![") {
                continue;
            }
            let above = &lines[n.saturating_sub(12)..n];
            let ok = above.iter().any(|l| l.contains("SAFETY:") || l.contains("# Safety"));
            if !ok {
                bad.push(format!("{}:{n}: {}", path.display(), line.trim()));
            }
        }
    }
    fail_if_any("unsafe without a SAFETY comment", bad);
}

/// No runtime thread ever sleeps: `std::thread::sleep` appears in product code only where the
/// line above says `// tidy: blocking context` (code that runs on the blocking pool or its own
/// thread). Async code waits with tokio's timers.
#[test]
fn no_thread_sleep_on_runtime_threads() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("thread::sleep") && !(n >= 2 && lines[n - 2].contains("tidy: blocking context")) {
                bad.push(format!("{}:{n}: {}", path.display(), line.trim()));
            }
        }
    }
    fail_if_any("std::thread::sleep outside a marked blocking context", bad);
}

/// Spans attach to futures, never to threads: product code does not hold a tracing span's
/// `enter()` guard (in an async fn it stays entered across every `.await`, so whatever else the
/// runtime thread runs meanwhile is logged under that span). Use `.instrument(span)`, or
/// `span.in_scope(..)` for synchronous code.
#[test]
fn spans_are_never_entered_by_guard() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("span.enter()") || code.contains("span!(") && code.contains(".enter()") {
                bad.push(format!("{}:{n}: {}", path.display(), line.trim()));
            }
        }
    }
    fail_if_any("a tracing span entered by guard (use .instrument or in_scope)", bad);
}

/// One proto boundary: only `agent/src/service/` imports `xfer_proto` in the agent (domain
/// modules never see protobuf types).
#[test]
fn only_the_service_module_knows_protobuf() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        let p = path.to_string_lossy();
        if !p.starts_with("agent/src/") || p.starts_with("agent/src/service/") {
            continue;
        }
        for (n, line) in product_lines(&text) {
            if line.split("//").next().unwrap_or("").contains("xfer_proto") {
                bad.push(format!("{p}:{n}: {}", line.trim()));
            }
        }
    }
    fail_if_any("xfer_proto used outside agent/src/service/", bad);
}

/// xferctl is a thin shell over `xfer-client` (issue 12): its code never names the generated
/// protobuf types or tonic, so everything it can do an application can do through the crate,
/// and a change to the wire format is made once, in the crate's `convert.rs`. In the crate,
/// only `convert.rs`, `lib.rs` (the calls), `channel.rs` (the channel stream's messages) and
/// `error.rs` (statuses into the error enum) speak protobuf or tonic.
#[test]
fn xferctl_and_the_client_crate_keep_one_proto_boundary() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        let p = path.to_string_lossy();
        let allowed: &[&str] = if p.starts_with("ctl/") {
            &[]
        } else if p.starts_with("crates/xfer-client/src/") {
            &["convert.rs", "lib.rs", "channel.rs", "error.rs"]
        } else {
            continue;
        };
        if allowed.iter().any(|f| p.ends_with(&format!("/{f}"))) {
            continue;
        }
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("xfer_proto") || code.contains("tonic::") || code.contains("pb::") {
                bad.push(format!("{p}:{n}: {}", line.trim()));
            }
        }
    }
    fail_if_any("protobuf or tonic outside the client crate's boundary", bad);
    let ctl = std::fs::read_to_string(workspace_root().join("ctl/Cargo.toml")).expect("ctl/Cargo.toml");
    let deps = ctl.split("[dev-dependencies]").next().unwrap_or("");
    assert!(!deps.contains("xfer-proto") && !deps.contains("tonic"), "xferctl depends on xfer-proto or tonic directly");
}

/// gRPC statuses are made in one place: `tonic::Status` is constructed only in
/// `agent/src/service/convert/status.rs` (every domain error maps there, so codes stay consistent).
#[test]
fn statuses_are_built_only_in_convert() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        let p = path.to_string_lossy();
        if !p.starts_with("agent/src/") || p.ends_with("service/convert/status.rs") {
            continue;
        }
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            let builds = code.match_indices("Status::").any(|(i, _)| {
                let before = &code[..i];
                let after = &code[i + "Status::".len()..];
                // `tonic::Status::x(` or `Status::x(`, not `WcStatus::`/`TransferStatus::`.
                !before.ends_with(|c: char| c.is_alphanumeric() || c == '_')
                    && after.starts_with(|c: char| c.is_ascii_lowercase())
                    && after.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().is_some_and(|f| after[f.len()..].starts_with('('))
            });
            if builds {
                bad.push(format!("{p}:{n}: {}", line.trim()));
            }
        }
    }
    fail_if_any("tonic::Status built outside service/convert/status.rs", bad);
}

/// Every source file opens with a `//!` module doc saying what it is for.
#[test]
fn every_file_has_a_module_doc() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        if !text.trim_start().starts_with("//!") {
            bad.push(path.display().to_string());
        }
    }
    fail_if_any("files without a //! module doc", bad);
}

/// No `unwrap()`/`expect(` in product code unless a comment within the three lines above (or on
/// the line) states the invariant that makes it safe.
#[test]
fn unwraps_state_their_invariant() {
    let mut bad = Vec::new();
    for (path, text) in product_sources() {
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            if !(code.contains(".unwrap()") || code.contains(".expect(")) {
                continue;
            }
            // Lines n-3..=n (1-based n is this line): a `//` comment (not a `//!` module doc),
            // on its own line or trailing this one.
            let from = n.saturating_sub(4);
            let commented = lines[from..n].iter().any(|l| l.contains("//") && !l.trim_start().starts_with("//!"));
            if !commented {
                bad.push(format!("{}:{n}: {}", path.display(), line.trim()));
            }
        }
    }
    fail_if_any("unwrap/expect without an invariant comment", bad);
}

/// The agent's modules are layered, lowest first; a module may use (`crate::X`) modules of its own
/// layer or below. That rules out import cycles across layers. The upward edges that exist today
/// are listed with why they remain; any other fails, and so does a listed one that is gone.
#[test]
fn modules_respect_the_layering() {
    const LAYERS: &[&[&str]] = &[
        &["sys", "metrics", "ids", "identity", "cpus", "peer_addr", "tenants", "safe_file", "labels", "deadline"], // process facts, metric names, ids, certificates, CPU sets, address spellings, shares, safe file writes, label rules, deadlines
        &["checksum"],                      // over region memory (xfer-rdma)
        &["verbs", "fabric", "shape"],      // the data plane: the Fabric trait, tcp and verbs; transfer shape bounds
        &["config"],                        // the validated configuration
        &["notify", "grants", "regions"],   // notifications, what peers may touch, and the memory itself
        &["transfer", "peer_api", "peers"], // transfer records and machine, peer calls and pool
        &["node"],                          // the operations, in domain types
        &["bench"],                         // benchmarks, above the core (Node's public calls)
        &["service", "admin"],              // the protobuf boundary: gRPC servers and client; the admin (metrics) HTTP server
        &["app"],                           // start-up
    ];
    const KNOWN_UPWARD: &[(&str, &str, &str)] = &[];
    let layer = |m: &str| LAYERS.iter().position(|l| l.contains(&m));
    let mut upward = std::collections::BTreeSet::new();
    let mut unknown_modules = std::collections::BTreeSet::new();
    for (path, text) in product_sources() {
        let p = path.to_string_lossy().to_string();
        let Some(rest) = p.strip_prefix("agent/src/") else { continue };
        let from = rest.split('/').next().unwrap_or(rest).trim_end_matches(".rs").to_string();
        if from == "lib" || from == "main" {
            continue;
        }
        let Some(lf) = layer(&from) else {
            unknown_modules.insert(from);
            continue;
        };
        for (_, line) in product_lines(&text) {
            let code = line.split("//").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                let to: String = code[i + 7..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                match layer(&to) {
                    Some(lt) if lt > lf => {
                        upward.insert((from.clone(), to));
                    }
                    None if !to.is_empty() => {
                        unknown_modules.insert(to);
                    }
                    _ => {}
                }
            }
        }
    }
    fail_if_any("modules missing from LAYERS", unknown_modules.into_iter().collect());
    let known: std::collections::BTreeSet<(String, String)> = KNOWN_UPWARD.iter().map(|(a, b, _)| (a.to_string(), b.to_string())).collect();
    fail_if_any(
        "new upward imports (a lower layer using a higher one)",
        upward.difference(&known).map(|(a, b)| format!("{a} -> {b}")).collect(),
    );
    fail_if_any(
        "listed upward imports that are gone (remove them)",
        known.difference(&upward).map(|(a, b)| format!("{a} -> {b}")).collect(),
    );
}
