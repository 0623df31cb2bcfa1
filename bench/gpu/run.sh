# The CUDA check of the model runner, run on a GPU machine (the device tool):
# a seeded MLP as TorchScript and as a .pt2 package compiled there for CUDA,
# each run through stoke-embedded on cuda:0 and compared with the eager model
# on the GPU; then the CUDA package on --device cpu, which must be refused.
# Carries a stripped, xz-compressed stoke-embedded (no cargo there):
#   strip + xz target/debug/stoke-embedded into .gpu/se.xz (excluded from git),
#   then on the device: REPO=$PWD bash bench/gpu/run.sh
set -u
W=/tmp/gpucheck; mkdir -p $W; cd $W
xz -dc "${STOKE_EMBEDDED_XZ:-$REPO/.gpu/se.xz}" > se && chmod +x se
TL=$(python3 -c "import torch,os;print(os.path.join(os.path.dirname(torch.__file__),'lib'))")
export LD_LIBRARY_PATH=$TL
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 "$REPO/bench/gpu/export.py" $W/fx > export.log 2>&1; grep -v -i warn export.log | tail -12
for m in pt2 pt; do
cat > job-$m.toml <<T
name = "gpu-$m"
[dataset]
format = "parquet"
uri = "file://$W/fx/data/"
id_column = "id"
[processor]
name = "pytorch"
[processor.params]
model = "file://$W/fx/model.$m"
input_column = "features"
outputs = ["argmax", "scores"]
[batching]
batch_size = 256
[sharding]
records = 1000
T
/usr/bin/time -f "$m wall %es" ./se job-$m.toml --root $W/root-$m --device cuda:0 2>&1 | tail -4
python3 "$REPO/bench/gpu/compare.py" $W/fx/ref.json $(ls -d $W/root-$m/jobs/*/outputs) "$m on cuda:0"
done
echo "== the CUDA package on --device cpu"
./se job-pt2.toml --root $W/root-cpu --device cpu > cpu.log 2>&1; echo "exit $?"; tail -1 cpu.log
