# shellcheck shell=bash disable=SC2034
# The simulated EKS GPU fleet: node shapes (allocatable resources, labels, taints) and the
# list of nodes. Sourced by hack/cluster.sh (kwok fake nodes) and hack/kind.sh (real kind
# nodes patched to look the same), so both paths offer the scheduler the same cluster.
# Numbers follow the EC2/EKS facts in DESIGN.md section 5.

# One line per node: name instance-type zone nodegroup network-node-layer-1/2/3.
# Layer 1 is the spine shared by the whole AZ, layer 3 the leaf closest to the node; gangs
# that share a leaf are closest. One p5 sits in a second AZ so placement can be checked. Eight
# p5en hold rollout servers spanning two nodes (LeaderWorkerSet groups) beside a one-node job.
fleet_nodes() {
  cat <<'EOF'
p5-0 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a01 nn-3a01
p5-1 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a01 nn-3a01
p5-2 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a01 nn-3a02
p5-3 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a01 nn-3a02
p5-4 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a02 nn-3a03
p5-5 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a02 nn-3a03
p5-6 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a02 nn-3a04
p5-7 p5.48xlarge us-west-2a gpu-p5 nn-1a00 nn-2a02 nn-3a04
p5-b-0 p5.48xlarge us-west-2b gpu-p5-b nn-1b00 nn-2b01 nn-3b01
p5en-0 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a03 nn-3a05
p5en-1 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a03 nn-3a05
p5en-2 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a03 nn-3a07
p5en-3 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a03 nn-3a07
p5en-4 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a05 nn-3a08
p5en-5 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a05 nn-3a08
p5en-6 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a05 nn-3a09
p5en-7 p5en.48xlarge us-west-2a gpu-p5en nn-1a00 nn-2a05 nn-3a09
cpu-0 m7i.8xlarge us-west-2a cpu nn-1a00 nn-2a04 nn-3a06
cpu-1 m7i.8xlarge us-west-2a cpu nn-1a00 nn-2a04 nn-3a06
cpu-2 m7i.8xlarge us-west-2a cpu nn-1a00 nn-2a04 nn-3a06
EOF
}

# Allocatable resources of an instance type, as "resource=quantity" lines.
shape_allocatable() {
  case "$1" in
    p5.48xlarge)
      printf '%s\n' cpu=191450m memory=1990Gi pods=110 ephemeral-storage=3500Gi \
        hugepages-2Mi=10Gi nvidia.com/gpu=8 vpc.amazonaws.com/efa=32 ;;
    p5en.48xlarge)
      printf '%s\n' cpu=191450m memory=1990Gi pods=110 ephemeral-storage=3500Gi \
        hugepages-2Mi=10Gi nvidia.com/gpu=8 vpc.amazonaws.com/efa=16 ;;
    m7i.8xlarge)
      printf '%s\n' cpu=31850m memory=124Gi pods=110 ephemeral-storage=450Gi ;;
    *) echo "fleet.sh: unknown instance type '$1'" >&2; return 1 ;;
  esac
}

# Capacity differs from allocatable only in cpu and memory (system and kubelet reservations).
shape_capacity() {
  case "$1" in
    p5.48xlarge|p5en.48xlarge) shape_allocatable "$1" | sed -e 's/^cpu=.*/cpu=192/' -e 's/^memory=.*/memory=2048Gi/' ;;
    m7i.8xlarge) shape_allocatable "$1" | sed -e 's/^cpu=.*/cpu=32/' -e 's/^memory=.*/memory=128Gi/' ;;
    *) shape_allocatable "$1" ;;
  esac
}

# GPU product label of an instance type; empty for CPU nodes.
shape_gpu_product() {
  case "$1" in
    p5.48xlarge) echo NVIDIA-H100-80GB-HBM3 ;;
    p5en.48xlarge) echo NVIDIA-H200 ;;
    *) echo "" ;;
  esac
}

# Node labels as "key=value" lines: the ones EKS, the NVIDIA and the EFA device plugins set.
node_labels() {
  local name="$1" type="$2" zone="$3" group="$4" l1="$5" l2="$6" l3="$7" gpu
  gpu="$(shape_gpu_product "$type")"
  printf '%s\n' \
    "kubernetes.io/hostname=$name" kubernetes.io/arch=amd64 kubernetes.io/os=linux \
    "node.kubernetes.io/instance-type=$type" "topology.kubernetes.io/region=${zone%?}" \
    "topology.kubernetes.io/zone=$zone" "topology.k8s.aws/network-node-layer-1=$l1" \
    "topology.k8s.aws/network-node-layer-2=$l2" "topology.k8s.aws/network-node-layer-3=$l3" \
    "eks.amazonaws.com/nodegroup=$group" eks.amazonaws.com/capacityType=ON_DEMAND
  if [ -n "$gpu" ]; then
    printf '%s\n' nvidia.com/gpu.present=true "nvidia.com/gpu.product=$gpu" nvidia.com/gpu.count=8 \
      vpc.amazonaws.com/efa.present=true
  fi
}

# The taint EKS GPU node groups carry so that only pods that ask for GPUs land there.
GPU_TAINT_KEY="nvidia.com/gpu"
GPU_TAINT_VALUE="true"
GPU_TAINT_EFFECT="NoSchedule"
