# vLLM's router (vllm-router on PyPI: a Rust binary in a Python wheel) for the Helm chart's
# router option (deploy/helm/pagedserve, `router`); its project publishes no image.
#
#   docker build -f docker/router.Dockerfile -t registry.example.com/vllm-router:0.1.17 .
#
# The version is the one benchmarks/peers/vllm_router.py installs and tests/integration/
# test_router_replicas.py runs pagedserve's replicas behind; keep them equal. Runs as UID
# and GID 1000 (the chart's runAsUser / runAsGroup) and writes nothing but /tmp, so the
# chart runs it on a read-only root filesystem.
#
# Not built on the CPU-only development machines (no Docker engine there): the image is
# untested; the same wheel runs in the integration test.
FROM python:3.12-slim

ARG VLLM_ROUTER_VERSION=0.1.17
# The wheel's extension links libstdc++ (its OpenSSL and PCRE2 come bundled).
RUN apt-get update && apt-get install -y --no-install-recommends libstdc++6 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
    && groupadd --gid 1000 router && useradd --uid 1000 --gid 1000 --no-create-home router

USER 1000:1000
EXPOSE 8080 29000
ENTRYPOINT ["vllm-router"]
CMD ["--help"]
