"""matplotlib for the commands that draw (estimate --plot, report): imported only when asked for,
off-screen, with one-line errors for a missing install and an unwritable file."""
from __future__ import annotations

from pathlib import Path

from ms_llm.errors import ConfigError


def pyplot(who: str, extra: str):
    """matplotlib.pyplot on the Agg backend; `who` names the flag or command in the error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"{who} needs matplotlib: pip install 'ms_llm[{extra}]'") from None
    return plt


def save(plt, fig, path: str | Path, who: str, dpi: int = 120) -> Path:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise ConfigError(f"{who}: cannot write {path} ({exc.strerror})") from None
    finally:
        plt.close(fig)
    return Path(path)
