"""Benchmarks and the harnesses they share."""
from pathlib import Path

# the checkout's vLLM + LMCache interpreter (scripts/setup_vllm_env.sh builds it)
VLLM_VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
