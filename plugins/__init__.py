"""Built-in rlcore plugins. They register through the ``rlcore.plugins`` entry-point group like any third party."""
