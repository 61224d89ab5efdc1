from setuptools import find_packages, setup

setup(
    name="mode",
    version="0.1.0",
    description="Mixture-of-Depths (MoD) and Mixture-of-Depths-and-Experts (MoDE) transformers",
    packages=find_packages(include=["mode", "mode.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "einops>=0.7",
        "pydantic>=2.5",
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "numpy>=1.24",
    ],
    extras_require={
        # triton: tests/test_kernels.py runs the Triton kernels in Triton's interpreter on CPU
        # (CUDA builds of torch bring their own triton). pytest-xdist: launch/test.sh runs the suite
        # on every core. ruff: the lint CI runs (.ci/ruff.toml).
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "triton>=3.2", "ruff>=0.6"],
        # DeepSpeed runs on CPU too (over gloo), for the distributed tests.
        "cpu-dist": ["deepspeed==0.19.8"],
        # Hugging Face models in and out (mode.hf) and tokenized data (mode.data prepare).
        "hf": ["transformers>=4.45", "safetensors>=0.4", "tokenizers>=0.20"],
        # TensorBoard event files beside each run's metrics (train.tensorboard).
        "track": ["tensorboard>=2.15"],
        "gpu": ["deepspeed==0.19.8", "megablocks==0.10.0", "grouped_gemm==0.3.0"],
    },
)
