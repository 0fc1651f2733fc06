"""What every layer of vitray may use and that needs nothing else from vitray: the one config
loader (:mod:`vitray.common.config`) and keeping credentials out of what is written
(:mod:`vitray.common.redact`)."""
