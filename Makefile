# xfer — build, test, demo and benchmarks. `make test` is the one test command (CI runs it).
CARGO ?= cargo
SETUP_STAMP := target/.setup-done

.PHONY: all build release test demo bench soak soak-rxe fuzz test-rxe bench-rxe image setup fmt clean

all: build

$(SETUP_STAMP): scripts/setup
	scripts/setup
	@mkdir -p target && touch $(SETUP_STAMP)

setup: $(SETUP_STAMP)

build: $(SETUP_STAMP)
	$(CARGO) build --workspace --bins

release: $(SETUP_STAMP)
	$(CARGO) build --release --workspace --bins

# The whole suite: formatting (rustfmt.toml), unit + integration tests (real agents on loopback),
# the Python package's pytest against real agents, clippy, manifests.
test: $(SETUP_STAMP)
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace
	scripts/python-test
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# The fuzz targets are their own workspace: a trait change must not break them unseen.
	$(CARGO) check --manifest-path fuzz/Cargo.toml --bins
	scripts/validate-manifests

demo: release
	target/release/xferctl demo

# TCP fabric vs raw TCP on loopback, same run; table + JSON in target/bench/.
bench: release
	scripts/bench-tcp

# N agents on loopback, mixed verified transfers, cancels and a peer restart (SOAK_SECS, default 600).
soak: release
	scripts/soak

# Coverage-guided fuzzing of the TCP frame decoder and request validation (cargo-fuzz on stable
# via RUSTC_BOOTSTRAP); FUZZ_SECS per target (default 60, CI 20).
fuzz: $(SETUP_STAMP)
	scripts/fuzz

soak-rxe: $(SETUP_STAMP)
	scripts/rxe-soak

test-rxe: $(SETUP_STAMP)
	scripts/rxe-test

bench-rxe: $(SETUP_STAMP)
	scripts/rxe-bench

# Container image without a Docker daemon or a registry: release binaries (stripped) on a
# mmdebstrap'd Debian rootfs, built with buildah and run with podman as a test (scripts/build-image).
# IMAGE_PROFILE=debug packs the binaries `make build` made instead (CI: no release build).
IMAGE_PROFILE ?= release
image: $(SETUP_STAMP)
	XFER_IMAGE_PROFILE=$(IMAGE_PROFILE) scripts/build-image

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml

clean:
	$(CARGO) clean
