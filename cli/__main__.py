from vitray.cli.main import main

main()
