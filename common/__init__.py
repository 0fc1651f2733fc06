"""What every layer of vitray may use and that needs nothing else from vitray: the one config
loader (:mod:`vitray.common.config`), keeping credentials out of what is written
(:mod:`vitray.common.redact`), a failure's one-line root cause (:mod:`vitray.common.failures`) and
what the commands' exit codes mean (:mod:`vitray.common.exit_codes`)."""
