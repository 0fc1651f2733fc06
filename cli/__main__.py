from vitray.cli.entry import main

main()
