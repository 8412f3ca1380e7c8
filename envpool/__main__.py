from millstream.envpool.worker import main

main()
