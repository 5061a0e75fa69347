# ropeattn container image: ropeattn-server + the ropeattn CLI on Debian 12.
# Build with deploy/build-image.sh (buildah, no Docker engine needed) or
# `docker build -t ropeattn:latest .`. See deploy/README.md, "Container image".

############################ build stage ############################
FROM debian:bookworm-slim AS build

WORKDIR /src
# The package list lives in one place (scripts/setup.sh). Copy it alone first
# so the package layer is reused while only sources change.
COPY scripts/setup.sh scripts/setup.sh
RUN bash scripts/setup.sh && rm -rf /var/lib/apt/lists/*

COPY . .
# Only the two shipped binaries; tests and benchmarks are not configured.
# ccache is installed by setup.sh but useless in a one-shot build: disabled.
RUN CCACHE_DISABLE=1 cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DROPEATTN_BUILD_TESTS=OFF -DROPEATTN_BUILD_BENCH=OFF \
 && CCACHE_DISABLE=1 cmake --build build -j "$(nproc)" --target ropeattn-server ropeattn \
 && strip --strip-unneeded build/bin/ropeattn-server build/bin/ropeattn \
 && echo "linked: $(ldd build/bin/ropeattn-server build/bin/ropeattn | awk '/=>/{print $1}' | sort -u | tr '\n' ' ')"

########################### runtime stage ###########################
FROM debian:bookworm-slim

# Exactly the shared libraries the two binaries link (checked with ldd):
# gRPC C++ / core, Protobuf, Abseil, oneDNN (+ its OpenCL loader dependency),
# the GNU OpenMP runtime, libmicrohttpd (/metrics), OpenSSL's libcrypto (the
# server checks that a TLS certificate and its key belong together), spdlog
# and fmt (the JSON-lines log) and the C++ runtime.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 \
        libdnnl2 ocl-icd-libopencl1 libgomp1 libmicrohttpd12 libssl3 libspdlog1.10 libfmt9 \
        libstdc++6 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log \
 && groupadd --gid 10001 ropeattn \
 && useradd --uid 10001 --gid 10001 --home-dir /nonexistent \
        --no-create-home --shell /usr/sbin/nologin ropeattn

COPY --from=build /src/build/bin/ropeattn-server /src/build/bin/ropeattn /usr/local/bin/
# Fail the build here, not at start-up, if a library is missing.
RUN if ldd /usr/local/bin/ropeattn-server /usr/local/bin/ropeattn | grep 'not found'; then \
      echo "runtime stage: unresolved shared libraries" >&2; exit 1; fi

LABEL org.opencontainers.image.title="ropeattn" \
      org.opencontainers.image.description="RoPE attention as a gRPC service (ropeattn-server + ropeattn CLI)" \
      org.opencontainers.image.licenses="see repository"

USER 10001:10001
# gRPC (Attend, Encode, Decode, health, reflection) and Prometheus /metrics.
EXPOSE 50051 9464

# The server's health is SERVING only while its compute canary passes. This
# check speaks plaintext, like the default command below; a container run
# with --tls_cert_file needs its own (e.g. docker run --health-cmd "ropeattn
# health --tls_ca_file ... --deadline_seconds 3"; Kubernetes ignores
# HEALTHCHECK and uses the exec probes in deploy/k8s).
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["ropeattn", "health", "--target", "127.0.0.1:50051", "--deadline_seconds", "3"]

# The image runs the server: arguments given to `docker run IMAGE ...` or a
# Kubernetes container's `args` are its flags (deploy/k8s gives only args;
# tests/deploy/manifest_test.cc checks the two agree). CMD holds the default
# flags: the built-in demo model on all interfaces. To serve checkpoints,
# mount them read-only and pass --model NAME=/models/NAME (deploy/README.md).
# Other programs of the image (the ropeattn CLI) need --entrypoint.
ENTRYPOINT ["ropeattn-server"]
CMD ["--address=0.0.0.0:50051", "--metrics_address=0.0.0.0:9464"]
