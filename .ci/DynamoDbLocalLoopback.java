// Starts AWS's DynamoDB Local listening on 127.0.0.1 only.
//
// DynamoDB Local has no bind-address option: its Jetty connector listens on every interface.
// This launcher builds the server from the usual command-line arguments, sets the connector's
// host to the loopback address before starting it, and then blocks like DynamoDB Local's main.
// Run with Java 17's single-file launcher:
//   java -cp 'DynamoDBLocal.jar:DynamoDBLocal_lib/*' -Djava.library.path=DynamoDBLocal_lib \
//        DynamoDbLocalLoopback.java -inMemory -sharedDb -port 8000
import java.lang.reflect.Field;
import org.eclipse.jetty.server.Connector;
import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;
import software.amazon.dynamodb.services.local.main.ServerRunner;
import software.amazon.dynamodb.services.local.server.DynamoDBProxyServer;

public class DynamoDbLocalLoopback {
    public static void main(String[] args) throws Exception {
        DynamoDBProxyServer proxy = ServerRunner.createServerFromCommandLineArgs(args);
        Field field = DynamoDBProxyServer.class.getDeclaredField("server");
        field.setAccessible(true);
        Server server = (Server) field.get(proxy);
        for (Connector c : server.getConnectors()) {
            if (c instanceof ServerConnector sc) {
                sc.setHost("127.0.0.1");
            }
        }
        proxy.start();
        System.out.println("DynamoDB Local listening on 127.0.0.1 " + String.join(" ", args));
        proxy.join();
    }
}
