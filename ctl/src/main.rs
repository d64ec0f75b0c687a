//! The `xferctl` binary; everything lives in the library (`xferctl::main`).
fn main() -> std::process::ExitCode {
    xferctl::main()
}
