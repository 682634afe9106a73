"""The live fleet both planes share: the engine instances by role (``registry``), written by the
control plane (``pdproxy.membership``) and read by the request path as one snapshot per
decision."""
