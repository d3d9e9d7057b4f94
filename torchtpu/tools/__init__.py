"""Tools for people and coding assistants, on top of every layer: ``doctor`` (what this machine
gives torchtpu), ``onboard`` (a model on tpu vs CPU, module by module), ``diagnose`` (where a
training step's time goes), ``mcp_server`` (all of them over the Model Context Protocol).
``watch`` records what a stretch of code made torchtpu do; nothing here costs anything until a
tool runs.
"""
