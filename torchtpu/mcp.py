"""``python -m torchtpu.mcp``: the tools as an MCP server on stdio (``tools/mcp_server.py``).

This module is ``torchtpu.mcp``; the ``mcp`` it imports is the PyPI package (absolute imports).
"""

import sys

from torchtpu.tools.mcp_server import build, main

__all__ = ["build", "main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
