//! The `xferctl` binary; everything lives in the library (`xferctl::main`).
#![forbid(unsafe_code)]
fn main() -> std::process::ExitCode {
    xferctl::main()
}
