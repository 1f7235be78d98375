"""A script whose import fails before it joins: the module does not exist."""

import elastic_no_such_module_xyz  # noqa: F401
