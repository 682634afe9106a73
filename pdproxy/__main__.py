from pdproxy.cli.main import main

main()
