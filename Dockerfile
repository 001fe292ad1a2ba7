# The image the Kubernetes manifests (python -m launch.k8s) expect: tfdist
# installed, `python -m tfdist.train` and `python -m tfdist.launch.task_config`
# on the path, and the bundled digits set prepared, so a pod downloads nothing.
#
#   CPU: docker build -t tfdist:cpu .
#   GPU: docker build --build-arg TF_EXTRA=gpu -t tfdist:gpu .
#        (tensorflow[and-cuda] brings the CUDA wheels; run with the NVIDIA
#        container runtime and --gpus_per_worker in launch.k8s)
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TF_EXTRA=cpu

WORKDIR /opt/tfdist
COPY pyproject.toml setup.cfg README.md ./
COPY tfdist tfdist
COPY models models
COPY launch launch
COPY tools tools
COPY configs configs
RUN pip install --no-cache-dir ".[${TF_EXTRA}]" \
    && python -c "from tfdist import digits; digits.prepare('/root/tensorflow_datasets')"

# Relative model_dirs land here; mount a volume (launch.k8s --volume) or use
# a gs:// or s3:// model_dir so checkpoints outlive the container.
WORKDIR /workspace
CMD ["python", "-m", "tfdist.train", "--helpshort"]
