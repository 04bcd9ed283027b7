"""rlcore: fast, pluggable RL post-training for Hugging Face causal language models."""

__version__ = "0.1.0"

#: The version of the plugin API (hooks, their arguments, the protocols of rlcore.protocols), ``major.minor``.
#: A minor release adds (a hook, an argument, an optional protocol method with a default); a plugin
#: written for an earlier minor keeps working. Only a major release removes or requires something,
#: announced first by a DeprecationWarning. ``rlcore plugins`` prints it; docs/plugins.md lists the changes.
PLUGIN_API_VERSION = "1.1"
