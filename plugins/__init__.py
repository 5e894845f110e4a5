"""Memory plugins shipped with rlm, one file each (installed as ``rlm.plugins``)."""
