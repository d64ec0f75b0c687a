//! Tidy: architecture invariants that the compiler does not check, checked over the source tree
//! (rust-analyzer's `tidy.rs` style). Each test names the invariant from ARCHITECTURE.md it
//! enforces and prints every offending `file:line`, so a failure says what to fix. What counts as
//! product code and what as test code is decided in `source.rs`; imports between files are read in
//! `imports.rs`.
// A tidy check that cannot read the tree has nothing better to do than fail.
#![allow(clippy::expect_used)]

mod imports;
mod source;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use source::{product_sources, workspace_root};

fn fail_if_any(what: &str, offenders: Vec<String>) {
    assert!(offenders.is_empty(), "{what}:\n  {}", offenders.join("\n  "));
}

/// The one crate allowed to contain `unsafe`.
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
        if p.starts_with(UNSAFE_CRATE) || p.starts_with("agent/tests/tidy/") {
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
    // Every crate root (library, binary, build script) of every crate but the unsafe one, found
    // rather than listed, so that a new crate is checked from its first commit.
    let roots: Vec<String> = sources_under(&["agent", "ctl", "proto", "crates"])
        .into_iter()
        .map(|(p, _)| p.to_string_lossy().into_owned())
        .filter(|p| !p.starts_with(UNSAFE_CRATE) && !p.contains("/tests/"))
        .filter(|p| p.ends_with("/src/lib.rs") || p.ends_with("/src/main.rs") || p.ends_with("/build.rs"))
        .collect();
    assert!(roots.len() >= 8, "tidy found only {} crate roots: {roots:?}", roots.len());
    for root in &roots {
        let text = std::fs::read_to_string(workspace_root().join(root)).expect("read crate root");
        if !text.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]") {
            bad.push(format!("{root}: crate root without #![forbid(unsafe_code)]"));
        }
    }
    fail_if_any("unsafe outside crates/xfer-rdma", bad);
}

/// Region memory is shared with the NIC, peers and other processes, so no safe function may hand
/// it out as a Rust reference: `RegionMemory`'s public API returns no `&[u8]`/`&mut [u8]`, and
/// slices over raw pointers are built only in the region-memory module (its `unsafe`
/// `transient_slice*` constructors serve the zero-copy socket calls elsewhere in the crate).
#[test]
fn region_memory_is_never_handed_out_as_a_slice() {
    let mut bad = Vec::new();
    let memory = product_sources().into_iter().filter(|s| s.path.ends_with(REGION_MEMORY)).count();
    assert_eq!(memory, 1, "{REGION_MEMORY} not found: update tidy");
    for src in product_sources() {
        let path = &src.path;
        let is_memory = path.ends_with(REGION_MEMORY);
        for (n, line) in src.product_lines() {
            let code = line.split("//").next().unwrap_or("");
            if is_memory
                && code.contains("pub fn")
                && (code.contains("-> &[u8]") || code.contains("&mut [u8]>") || code.contains("-> &mut [u8]") || code.contains("Result<&"))
            {
                bad.push(format!("{}:{n}: public accessor returns a reference into region memory: {}", path.display(), line.trim()));
            }
            // Other modules of the rdma crate reach region bytes only through the memory module's
            // `unsafe` transient constructors, whose `# Safety` bounds a slice to one call.
            let builds = code.contains("from_raw_parts") || code.replace(".transient_slice_mut(", "").contains("slice_mut(");
            if !is_memory && builds {
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
    for src in product_sources() {
        let (path, text) = (&src.path, &src.text);
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in src.product_lines() {
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
    for src in product_sources() {
        let path = &src.path;
        for (n, line) in src.product_lines() {
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
    for src in product_sources() {
        let path = &src.path;
        let p = path.to_string_lossy();
        if !p.starts_with("agent/src/") || p.starts_with("agent/src/service/") {
            continue;
        }
        for (n, line) in src.product_lines() {
            if line.split("//").next().unwrap_or("").contains("xfer_proto") {
                bad.push(format!("{p}:{n}: {}", line.trim()));
            }
        }
    }
    fail_if_any("xfer_proto used outside agent/src/service/", bad);
}

/// xferctl is a thin shell over `xfer-client`: its code never names the generated
/// protobuf types or tonic, so everything it can do an application can do through the crate,
/// and a change to the wire format is made once, in the crate's `convert.rs`. In the crate,
/// only `convert.rs`, `lib.rs` (the calls), `channel.rs` (the channel stream's messages) and
/// `error.rs` (statuses into the error enum) speak protobuf or tonic.
#[test]
fn xferctl_and_the_client_crate_keep_one_proto_boundary() {
    let mut bad = Vec::new();
    for src in product_sources() {
        let path = &src.path;
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
        for (n, line) in src.product_lines() {
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
    for src in product_sources() {
        let path = &src.path;
        let p = path.to_string_lossy();
        if !p.starts_with("agent/src/") || p.ends_with("service/convert/status.rs") {
            continue;
        }
        for (n, line) in src.product_lines() {
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
    for src in product_sources() {
        let (path, text) = (&src.path, &src.text);
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
    for src in product_sources() {
        let (path, text) = (&src.path, &src.text);
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in src.product_lines() {
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

/// Files stay small enough to read whole: no product `.rs` file over 600 lines (its unit tests
/// included: they are read with it). Split by role, not at the line limit.
#[test]
fn no_file_is_over_600_lines() {
    let bad = product_sources()
        .into_iter()
        .filter(|s| s.text.lines().count() > 600)
        .map(|s| format!("{}: {} lines", s.display(), s.text.lines().count()))
        .collect();
    fail_if_any("product files over 600 lines", bad);
}

/// Imports are named: no `use super::*` (or `super::super::*`) outside test modules, where a
/// glob hides which of the parent's names a file depends on.
#[test]
fn no_glob_imports_from_a_parent() {
    let mut bad = Vec::new();
    for src in product_sources() {
        for (n, code) in src.product_code() {
            let squashed: String = code.chars().filter(|c| !c.is_whitespace()).collect();
            let glob = squashed.match_indices("usesuper::").any(|(i, _)| {
                let rest = squashed[i + "usesuper::".len()..].trim_start_matches("super::");
                rest.starts_with('*')
            });
            if glob {
                bad.push(format!("{}:{n}: {}", src.display(), code.trim()));
            }
        }
    }
    fail_if_any("`use super::*` outside test modules", bad);
}

/// Comments say why in the code's own terms: none cites a tracker issue ("issue 12", "issue
/// #12") or a design-document section ("DESIGN §9", "DESIGN.md §9"), which a reader of the code
/// cannot follow and which go stale. Unit tests in product files included.
#[test]
fn comments_cite_no_issue_or_design_section() {
    let mut bad = Vec::new();
    for src in product_sources() {
        for (i, comment) in src.comments.iter().enumerate() {
            if cites_issue_or_design(comment) {
                bad.push(format!("{}:{}: {}", src.display(), i + 1, comment.trim()));
            }
        }
    }
    fail_if_any("comments citing an issue number or a DESIGN section", bad);
}

/// "issue 12", "Issue #12", "DESIGN §9", "DESIGN.md §9" (any case for "issue").
fn cites_issue_or_design(comment: &str) -> bool {
    let lower = comment.to_lowercase();
    let issue = lower.match_indices("issue").any(|(i, _)| {
        let before_ok = !lower[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        let rest = lower[i + "issue".len()..].trim_start_matches([' ', '\t']);
        let rest = rest.strip_prefix('#').unwrap_or(rest);
        before_ok && lower[i + "issue".len()..].starts_with([' ', '\t', '#']) && rest.starts_with(|c: char| c.is_ascii_digit())
    });
    let design = comment.match_indices("DESIGN").any(|(i, _)| {
        let rest = &comment[i + "DESIGN".len()..];
        let rest = rest.strip_prefix(".md").unwrap_or(rest).trim_start();
        rest.starts_with('§')
    });
    issue || design
}

/// The transfer state machines are sans-IO: they never read the clock, so a test drives time by
/// passing `now`. No `Instant::now`, `SystemTime::now` or `tokio::time` in the engine crate
/// (`crates/xfer-engine/src`) or, where they still live in the agent, in the transfer session,
/// chunk machine, batches and failure codes.
#[test]
fn state_machines_never_read_the_clock() {
    const MACHINES: &[&str] = &[
        "crates/xfer-engine/src/",
        "agent/src/transfer/session",
        "agent/src/transfer/machine",
        "agent/src/transfer/batch",
        "agent/src/transfer/failure",
    ];
    let mut bad = Vec::new();
    let mut checked = 0;
    for src in product_sources() {
        let p = src.path.to_string_lossy().into_owned();
        if !MACHINES.iter().any(|m| p.starts_with(m)) {
            continue;
        }
        checked += 1;
        for (n, code) in src.product_code() {
            let squashed: String = code.chars().filter(|c| !c.is_whitespace()).collect();
            if ["Instant::now", "SystemTime::now", "tokio::time"].iter().any(|w| squashed.contains(w)) {
                bad.push(format!("{p}:{n}: {}", code.trim()));
            }
        }
    }
    assert!(checked >= 4, "tidy found only {checked} state-machine files: update MACHINES");
    fail_if_any("a state machine reads the clock", bad);
}

/// No import circles between the files of a crate: if `a.rs` uses `b.rs` (a `crate::`, `super::`
/// or `self::` path, see `imports.rs`), nothing `b.rs` uses leads back to `a.rs`, directly or
/// through other files. A circle means neither file can be read, tested or moved without the
/// other.
#[test]
fn no_import_circles_between_files() {
    let edges = imports::edges(&product_sources());
    let graph = edges.iter().map(|(a, to)| (a.clone(), to.keys().cloned().collect())).collect();
    fail_if_any("import circles between files (each edge: the first import that makes it)", describe(&graph, &edges, |f| f.to_string()));
}

/// No import circles between the top-level modules of a crate (`node`, `service`, `transfer`,
/// …), taken whole: the files of one module may use another module, or be used by it, not both.
///
/// This replaces the hand-kept list of layers this test used to check the agent's modules
/// against: what that list guarded was that no module uses one that uses it back, which is
/// what this finds, in every crate, without a list to keep in step with the tree; the order
/// between crates (`xfer-engine` below `xfer-fabric` below the agent) is Cargo's to enforce.
#[test]
fn no_import_circles_between_modules() {
    let edges = imports::edges(&product_sources());
    let top = |file: &str| -> String {
        match imports::module_of(std::path::Path::new(file)) {
            Some((krate, m)) if !m.is_empty() => format!("{krate}: {}", m[0]),
            Some((krate, _)) => format!("{krate}: (crate root)"),
            None => file.to_string(),
        }
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, to) in &edges {
        for b in to.keys() {
            if top(a) != top(b) {
                graph.entry(top(a)).or_default().insert(top(b));
            }
        }
    }
    fail_if_any("import circles between top-level modules (each edge: one import that makes it)", describe(&graph, &edges, top));
}

/// One line per circle: its members, then each edge between them with the import that makes it.
fn describe(graph: &BTreeMap<String, BTreeSet<String>>, edges: &imports::Edges, node: impl Fn(&str) -> String) -> Vec<String> {
    let mut out = Vec::new();
    for group in imports::circles(graph) {
        let mut msg = group.join(" <-> ");
        for (a, to) in edges {
            for (b, uses) in to {
                let (na, nb) = (node(a), node(b));
                if na != nb && group.contains(&na) && group.contains(&nb) {
                    let u = &uses[0];
                    msg.push_str(&format!("\n      {a}:{} -> {b} ({})", u.line, u.path));
                }
            }
        }
        out.push(msg);
    }
    out
}

/// The checks above see what they should: test code is the `#[cfg(test)]` items (brace-matched,
/// however long), and code after a test-only function is product code again; strings and char
/// literals are not code or comments; imports resolve `super::` to the parent's file.
#[test]
fn tidy_reads_code_as_written() {
    let text = r##"//! doc
use super::*;
fn product() { let s = "// not a comment {"; let c = '{'; let r = r#"}"#; }
#[cfg(test)]
#[allow(dead_code)]
fn only_in_tests(x: [u8; 4]) {
    if x[0] == b'}' { loop {} }
}
fn worker_loop() { x.unwrap(); } // issue 7
#[cfg(test)]
mod tests;
#[cfg(test)]
mod inline {
    fn f() {}
}
fn after() -> &'static str { "DESIGN §3" }
"##;
    let s = source::Source::parse(std::path::Path::new("agent/src/a/b.rs"), text.to_string());
    let test_lines: Vec<usize> = (0..s.test.len()).filter(|&i| s.test[i]).map(|i| i + 1).collect();
    assert_eq!(test_lines, vec![4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]);
    assert_eq!(s.test_mods, vec!["tests".to_string()]);
    assert!(s.product_code().any(|(n, c)| n == 9 && c.contains("unwrap")), "the worker loop is product code");
    assert!(!s.code[2].contains("not a comment") && s.comments[2].trim().is_empty(), "{:?}", s.code[2]);
    assert!(s.code[2].contains("let r = r#\"") && s.code[2].trim_end().ends_with('}'), "{:?}", s.code[2]);
    assert!(cites_issue_or_design(&s.comments[8]) && !cites_issue_or_design(&s.comments[15]), "a string is not a comment");
    assert!(!cites_issue_or_design("// the host-safety issue, 2 bullets") && cites_issue_or_design("/// see Issue #12"));
    let parent = source::Source::parse(std::path::Path::new("agent/src/a.rs"), "//! a\npub mod b;\n".into());
    let edges = imports::edges(&[s, parent]);
    assert_eq!(edges["agent/src/a/b.rs"].keys().collect::<Vec<_>>(), vec!["agent/src/a.rs"], "use super::* names a.rs");
}

/// One way to post: a transfer's, a channel batch's and a benchmark phase's `Post`s become
/// `WorkRequest`s only in `agent/src/transfer/job.rs` (`WrTemplate::wr`), so what a work request
/// carries (its keys, offsets, signalling, notification slot) is decided in one place. The
/// fabrics' own tests build requests to test the fabrics; product code elsewhere does not.
#[test]
fn work_requests_are_built_in_one_place() {
    let mut bad = Vec::new();
    for src in product_sources() {
        let p = src.path.to_string_lossy().into_owned();
        if p == "agent/src/transfer/job.rs" || !(p.starts_with("agent/src/") || p.starts_with("ctl/src/")) {
            continue;
        }
        for (n, line) in src.product_code() {
            if line.contains("WorkRequest {") {
                bad.push(format!("{p}:{n}: {}", line.trim()));
            }
        }
    }
    fail_if_any("a WorkRequest built outside transfer/job.rs", bad);
}
