from millstream.actor.main import main

main()
