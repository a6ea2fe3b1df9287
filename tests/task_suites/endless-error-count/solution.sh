/opt/logtools/count-errors "$LOG_DIR/app.log" > /home/user/error_count.txt
